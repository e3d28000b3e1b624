"""ConvNeXt from timm, DP-ready: LayerNorm (no batch statistics) and biases everywhere already;
each block's loose layer scale γ is moved into a LayerScale module so its per-sample gradient has a
rule (:mod:`dpzoo.surgery.layerscale`, bit-exact outputs). LayerNorm-trained ImageNet weights need
no normalisation conversion, so the pretrained tags are DP-ready as they are: private fine-tuning
starts from a network trained with the normalisation it is fine-tuned with.
"""

from __future__ import annotations

from ..registry import ModelCard
from ._common import card_overrides
from ._timm import (
    bool_override,
    common_timm_overrides,
    float_override,
    int_list_override,
    int_override,
    num_classes_override,
    register_timm_entry,
)

OVERRIDES = {
    "num_classes": num_classes_override(),
    "in_chans": int_override("in_chans", "input channels (default 3)"),
    "depths": int_list_override("depths", 4, "blocks per stage, 4 integers (default 3, 3, 9, 3)"),
    "dims": int_list_override("dims", 4, "channels per stage, 4 integers (default 96, 192, 384, 768)"),
    "ls_init_value": float_override("ls_init_value", "initial layer scale γ (default 1e-6)", lo=1e-12, hi=10.0),
    "conv_mlp": bool_override("conv_mlp", "the MLP as 1×1 convolutions, channels first (default False)"),
    "drop_rate": float_override("drop_rate", "dropout before the classifier"),
    "drop_path_rate": float_override("drop_path_rate", "stochastic depth rate"),
    **common_timm_overrides("'avg' (default), 'max', 'avgmax'"),
}
TAGS = {
    "fb_in1k": "timm hub `timm/convnext_tiny.fb_in1k` (ImageNet-1k, LayerNorm: DP-ready as it is)",
    "fb_in22k_ft_in1k": "timm hub `timm/convnext_tiny.fb_in22k_ft_in1k` (ImageNet-22k, fine-tuned on 1k; LayerNorm: "
    "DP-ready as it is)",
}

_CARD = ModelCard(
    name="convnext-tiny",
    summary="ConvNeXt-Tiny from timm, its layer scale made visible to per-sample rules; LayerNorm weights DP-ready as they are.",
    architecture="timm `convnext_tiny` (depths 3-3-9-3, dims 96-768)",
    library="timm",
    task="image-classification",
    patches=(
        "each block's layer scale γ moved into a LayerScale module after its MLP (same outputs, bit for bit; "
        "timm's `gamma` keys still load)",
        "none else needed: LayerNorm, every convolution and Linear have biases",
    ),
    weight_source=(
        "random initialisation; `pretrained=True`: timm hub (LayerNorm weights, no conversion: DP-ready as they "
        "are); `weights=PATH`: a local timm checkpoint"
    ),
    pretrained_tags=TAGS,
    license="Apache-2.0 (timm code and weights)",
    papers=(
        "Liu et al., A ConvNet for the 2020s, CVPR 2022",
        "De et al., Unlocking High-Accuracy Differentially Private Image Classification through Scale, 2022 "
        "(private fine-tuning of ImageNet-pretrained networks)",
    ),
    overrides=card_overrides(OVERRIDES),
    test_overrides={"num_classes": 10, "depths": [1, 1, 1, 1], "dims": [8, 16, 32, 64], "ls_init_value": 0.5},
    # its 4× stem and three 2× downsamplings (2×2 convolutions, no padding) need 32 pixels: digits are upscaled
    train_defaults={"image_size": 32},
    example_input={"kind": "image", "shape": [3, 32, 32]},
    notes=(
        "The pretrained tags were trained with LayerNorm, the normalisation dpzoo fine-tunes them with: unlike "
        "the ResNets' BatchNorm tags, they need no non-private adaptation before private fine-tuning. Any "
        "input size that survives the 4× stem and three 2× downsamplings works (32×32 and up)."
    ),
)

convnext_tiny = register_timm_entry(_CARD, "convnext_tiny", default_tag="fb_in1k", overrides_table=OVERRIDES)
