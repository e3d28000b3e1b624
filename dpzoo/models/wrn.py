"""wrn16-4-gn and wrn28-10-gn: the Wide ResNets with GroupNorm of DP image classification.

De, Berrada, Hayes, Smith & Balle, "Unlocking High-Accuracy Differentially Private Image
Classification through Scale" (2022), §3 and §4.1: a WRN-16-4 (Zagoruyko & Komodakis, "Wide
Residual Networks", BMVC 2016) with GroupNorm instead of BatchNorm (16 groups), trained with
DP-SGD at large batch sizes, is their CIFAR-10 model from scratch (81.4% at ε = 8 with
augmentation multiplicity and weight averaging). They also standardise the convolution weights;
this version does not: a standardised weight is a function of the parameter, which the per-sample
rule of a convolution does not see (dpzoo would refuse it), and GroupNorm alone is DP-ready.

Pre-activation blocks (GroupNorm → ReLU → conv 3×3, twice, plus the identity or a 1×1
convolution when the shape changes), three stages of width 16·k, 32·k, 64·k with strides 1, 2, 2,
(depth − 4) / 6 blocks each, then GroupNorm → ReLU → global average pool → linear. Written
DP-ready: no BatchNorm, biases on every layer, no in-place ops.
"""

from __future__ import annotations

from functools import partial

from torch import nn

from ..errors import OverrideError
from ..registry import ModelCard, register_model
from ._common import from_scratch

__all__ = ["WideResNet"]

NAME = "wrn16-4-gn"


def _norm(channels: int, groups: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(groups, channels), channels)


class WideBlock(nn.Module):
    """A pre-activation residual block: GN → ReLU → conv 3×3 (stride), GN → ReLU → conv 3×3."""

    def __init__(self, c_in: int, c_out: int, stride: int, groups: int):
        super().__init__()
        self.norm1, self.act1 = _norm(c_in, groups), nn.ReLU()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1)
        self.norm2, self.act2 = _norm(c_out, groups), nn.ReLU()
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1)
        self.shortcut = nn.Conv2d(c_in, c_out, 1, stride) if stride != 1 or c_in != c_out else None

    def forward(self, x):
        pre = self.act1(self.norm1(x))
        out = self.conv2(self.act2(self.norm2(self.conv1(pre))))
        return out + (self.shortcut(pre) if self.shortcut is not None else x)


class WideResNet(nn.Module):
    """WRN-``depth``-``width`` with GroupNorm (``groups`` per layer, fewer when a layer is narrower)."""

    def __init__(self, num_classes: int = 10, in_chans: int = 3, depth: int = 16, width: int = 4, groups: int = 16):
        super().__init__()
        if depth < 10 or (depth - 4) % 6:
            raise OverrideError(f"WideResNet: depth {depth} must be 6n + 4 with n ≥ 1 (10, 16, 22, 28, ...).")
        blocks, widths = (depth - 4) // 6, [16 * width, 32 * width, 64 * width]
        self.stem = nn.Conv2d(in_chans, 16, 3, 1, 1)
        layers, c = [], 16
        for stage, (w, stride) in enumerate(zip(widths, (1, 2, 2))):
            for i in range(blocks):
                layers.append(WideBlock(c, w, stride if i == 0 else 1, groups))
                c = w
        self.blocks = nn.Sequential(*layers)
        self.head = nn.Sequential(_norm(c, groups), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(c, num_classes)

    def forward(self, x):
        return self.classifier(self.head(self.blocks(self.stem(x))))


def _card(name: str, depth: int, width: int, summary: str, role: str) -> ModelCard:
    return ModelCard(
        name=name,
        summary=summary,
        architecture=f"dpzoo `WideResNet` (depth {depth}, widening {width}): conv stem, 3 stages of pre-activation "
        "blocks [GN → ReLU → conv 3×3] × 2, GN → ReLU → average pool → linear",
        library="dpzoo",
        task="image-classification",
        patches=("written DP-ready: GroupNorm (16 groups), biases on every layer, no in-place ops",),
        license="Apache-2.0",
        papers=(
            "De et al., Unlocking High-Accuracy Differentially Private Image Classification through Scale, 2022, §3-4",
            "Zagoruyko & Komodakis, Wide Residual Networks, BMVC 2016",
        ),
        overrides={
            "num_classes": "output classes (default 10)",
            "in_chans": "input channels (default 3)",
            "depth": f"layers, 6n + 4 (default {depth}: {(depth - 4) // 6} blocks per stage)",
            "width": f"the widening factor k: stages of 16k, 32k, 64k channels (default {width})",
            "groups": "GroupNorm groups per layer (default 16, as De et al.)",
        },
        test_overrides={"depth": 10, "width": 1, "num_classes": 10},
        example_input={"kind": "image", "shape": [3, 32, 32]},
        notes=(
            f"{role} No pretrained weights here: train it from scratch, or restore your own with dpzoo.load(DIR). "
            "De et al.'s weight standardisation is left out (a standardised weight is not the convolution's "
            "parameter, which per-sample clipping needs)."
        ),
    )


_CARD = _card(
    NAME,
    16,
    4,
    "Wide ResNet 16-4 with GroupNorm: De et al. (2022)'s DP-SGD model for CIFAR-10 from scratch.",
    "De et al. train it from scratch on CIFAR-10.",
)
_CARD_28_10 = _card(
    "wrn28-10-gn",
    28,
    10,
    "Wide ResNet 28-10 with GroupNorm: the larger Wide ResNet of De et al. (2022), 36M parameters.",
    "De et al. use it where more capacity pays: fine-tuning after pre-training on public data.",
)


@register_model(NAME, card=_CARD)
def wrn16_4_gn(pretrained: bool = False, pretrained_tag: str | None = None, weights=None, **overrides) -> nn.Module:
    return from_scratch(_CARD, WideResNet, pretrained, pretrained_tag, weights, overrides)


@register_model("wrn28-10-gn", card=_CARD_28_10)
def wrn28_10_gn(pretrained: bool = False, pretrained_tag: str | None = None, weights=None, **overrides) -> nn.Module:
    return from_scratch(
        _CARD_28_10, partial(WideResNet, depth=28, width=10), pretrained, pretrained_tag, weights, overrides
    )
