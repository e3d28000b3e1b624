"""wrn16-4-gn: the Wide ResNet with GroupNorm that DP image classification trains from scratch.

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
            raise OverrideError(f"{NAME}: depth {depth} must be 6n + 4 with n ≥ 1 (10, 16, 22, 28, ...).")
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


_CARD = ModelCard(
    name=NAME,
    summary="Wide ResNet 16-4 with GroupNorm: De et al. (2022)'s DP-SGD model for CIFAR-10 from scratch.",
    architecture="dpzoo `WideResNet`: conv stem, 3 stages of pre-activation blocks [GN → ReLU → conv 3×3] × 2, "
    "GN → ReLU → average pool → linear",
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
        "depth": "layers, 6n + 4 (default 16: 2 blocks per stage)",
        "width": "the widening factor k: stages of 16k, 32k, 64k channels (default 4)",
        "groups": "GroupNorm groups per layer (default 16, as De et al.)",
    },
    test_overrides={"depth": 10, "width": 1, "num_classes": 10},
    example_input={"kind": "image", "shape": [3, 32, 32]},
    notes=(
        "No pretrained weights: De et al. train it from scratch. Their weight standardisation is left out "
        "(a standardised weight is not the convolution's parameter, which per-sample clipping needs)."
    ),
)


@register_model(NAME, card=_CARD)
def wrn16_4_gn(pretrained: bool = False, pretrained_tag: str | None = None, weights=None, **overrides) -> nn.Module:
    return from_scratch(_CARD, WideResNet, pretrained, pretrained_tag, weights, overrides)
