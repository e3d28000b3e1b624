"""ResNet-GN with biases: timm ResNets made DP-ready.

DP-BiTFiT paper App. A.2: BatchNorm → GroupNorm (BN mixes samples), and a zero bias on
every convolution (§3.4, BiTFiT-Add) so that DP-BiTFiT trains every layer. Residual
blocks run out of place so backward hooks (Opacus, dpzoo) work unchanged.
"""

from __future__ import annotations

from ..registry import ModelCard
from ._common import card_overrides
from ._timm import (
    choice_override,
    common_timm_overrides,
    float_override,
    int_list_override,
    int_override,
    num_classes_override,
    register_timm_entry,
    stage_width_override,
)

_PAPERS = (
    "He et al., Deep Residual Learning for Image Recognition, CVPR 2016",
    "Wu & He, Group Normalization, ECCV 2018",
    "Bu et al., Differentially Private Bias-Term Fine-tuning of Foundation Models (DP-BiTFiT), "
    "ICML 2024: §3.4 (BiTFiT-Add), App. A.2 (ResNet-GN)",
)

OVERRIDES = {
    "num_classes": num_classes_override(),
    "in_chans": int_override("in_chans", "input channels (default 3)"),
    "layers": int_list_override("layers", 4, "blocks per stage, 4 integers (default the architecture's)"),
    "width": stage_width_override(
        "channels of the first stage w; stages use w, 2w, 4w, 8w (default 64; the 7×7 stem keeps timm's 64)"
    ),
    "drop_rate": float_override("drop_rate", "dropout before the classifier"),
    "drop_path_rate": float_override("drop_path_rate", "stochastic depth rate"),
    "drop_block_rate": float_override("drop_block_rate", "DropBlock rate (timm: stages 3 and 4)"),
    "output_stride": choice_override(
        "output_stride", "8, 16 or 32 (default): dilated stages 3-4 keep larger feature maps", (8, 16, 32)
    ),
    **common_timm_overrides("'avg' (default), 'max', 'avgmax', 'catavgmax' (doubles the classifier's inputs), 'fast'"),
}
_PATCHES = (
    "BatchNorm2d → GroupNorm (groups: largest divisor of C ≤ 32 with ≥ 2 channels per group; BN's γ, β copied)",
    "BiTFiT-Add: a zero bias on every Conv2d (the fc layer already has one)",
    "in-place ReLU and `x += shortcut` replaced by out-of-place ops (safe under backward hooks)",
)


def _card(name: str, arch: str, depth: int, tag: str, gn_tag: str | None = None) -> ModelCard:
    tags = {
        tag: f"timm hub `timm/{arch}.{tag}` (ImageNet-1k, BatchNorm: converted to GroupNorm, not DP-ready as it is: adapt it without DP on public data first)"
    }
    if gn_tag is not None:  # the default: trained with GroupNorm, DP-ready as it is
        tags = {
            gn_tag: f"timm hub `timm/{arch}_gn.a1h_in1k` (ImageNet-1k, trained with GroupNorm: DP-ready as it is; default)",
            **tags,
        }
    return ModelCard(
        name=name,
        summary=f"ResNet-{depth} with GroupNorm and a bias on every convolution, ready for DP-SGD and DP-BiTFiT.",
        architecture=f"timm `{arch}` (ResNet-{depth})",
        library="timm",
        task="image-classification",
        patches=_PATCHES,
        weight_source=(
            "random initialisation; `pretrained=True` loads timm's ImageNet weights: "
            + (
                "by default GroupNorm-trained ones, DP-ready as they are; the BatchNorm tag is converted"
                if gn_tag
                else "BatchNorm-trained, converted"
            )
            + " (GroupNorm statistics differ from BatchNorm's: a converted tag is not DP-ready as it is, adapt it "
            "without DP on public data first); "
            "`weights=PATH` loads a local timm checkpoint, BatchNorm or GroupNorm"
        ),
        pretrained_tags=tags,
        license="Apache-2.0 (timm code and weights)",
        papers=_PAPERS,
        overrides=card_overrides(OVERRIDES),
        # ResNet-18/34: two groups. The 'auto' rule's two channels per group over the 1×1 maps of small
        # images leave little more than signs (non-private 30% on 16-pixel digits, 95% with two groups);
        # ResNet-50's bottlenecks have four times the channels, and the 'auto' rule trains better there
        test_overrides={
            "num_classes": 10,
            "layers": [1, 1, 1, 1],
            "width": 8,
            **({"gn_groups": 2} if depth < 50 else {}),
        },
        example_input={"kind": "image", "shape": [3, 32, 32]},
        notes=(
            "Group counts follow the 'auto' rule unless `gn_groups` is given"
            + (
                " (the small configuration uses 2: on small images the 'auto' rule's two channels per group over "
                "1×1 maps leave little more than signs)"
                if depth < 50
                else ""
            )
            + ". Any input size "
            "works (global average pooling). `features_only=True` (with `out_indices`) gives timm's "
            "`FeatureListNet` backbone, a list of feature maps (stem and the four stages by default), "
            "patched like the classifier: GroupNorm, a bias on every convolution, out-of-place blocks; "
            "per-sample gradient norms of any loss on the maps are exact (tested against per-sample "
            "backward passes). `weights=PATH` with it loads a classifier checkpoint's backbone, as timm "
            "does for pretrained weights; `num_classes` does not apply."
        ),
    )


resnet18_gn_bias = register_timm_entry(
    _card("resnet18-gn-bias", "resnet18", 18, "a1_in1k"), "resnet18", default_tag="a1_in1k", overrides_table=OVERRIDES
)
resnet34_gn_bias = register_timm_entry(
    _card("resnet34-gn-bias", "resnet34", 34, "a1_in1k"), "resnet34", default_tag="a1_in1k", overrides_table=OVERRIDES
)
_GN_TAG = "gn_a1h_in1k"  # timm's ResNet-50 trained with GroupNorm(32) in place of BatchNorm: the same tensors
resnet50_gn_bias = register_timm_entry(
    _card("resnet50-gn-bias", "resnet50", 50, "a1_in1k", gn_tag=_GN_TAG),
    "resnet50",
    default_tag=_GN_TAG,
    overrides_table=OVERRIDES,
    tag_sources={_GN_TAG: "resnet50_gn.a1h_in1k"},
)
