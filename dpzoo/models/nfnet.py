"""NF-ResNet-50 from timm: a normaliser-free ResNet (Brock et al. 2021), DP-ready as it is.

No normalisation layer at all: every convolution standardises its own weight (timm's
``ScaledStdConv2d``, whose per-sample rule treats the standardisation exactly,
:mod:`dpzoo.grad_norms.rules.conv`), and every convolution has a bias. So nothing mixes samples
and the ImageNet weights need no conversion: private fine-tuning starts from the network as it
was trained, as in De et al. (2022)'s ImageNet results with NFNets. The only patch is
out-of-place activations (backward hooks need the activations unchanged).

timm keeps the stage sizes in a configuration object (``NfCfg``), not in keyword arguments, so
``depths``, ``channels`` and ``stem_chs`` build the network from a copy of ``nf_resnet50``'s
configuration with them replaced (random initialisation, or a local checkpoint of that layout).
"""

from __future__ import annotations

import dataclasses

from torch import nn

from ..registry import ModelCard
from ._common import card_overrides
from ._timm import (
    common_timm_overrides,
    float_override,
    int_list_override,
    int_override,
    num_classes_override,
    register_timm_entry,
    timm_rejections,
)

_CFG_KEYS = ("depths", "channels", "stem_chs")

OVERRIDES = {
    "num_classes": num_classes_override(),
    "in_chans": int_override("in_chans", "input channels (default 3)"),
    "depths": int_list_override("depths", 4, "blocks per stage, 4 integers (default 3, 4, 6, 3)"),
    "channels": int_list_override(
        "channels", 4, "output channels per stage, 4 integers (default 256, 512, 1024, 2048)"
    ),
    "stem_chs": int_override("stem_chs", "channels of the 7×7 stem (default 64)"),
    "drop_rate": float_override("drop_rate", "dropout before the classifier"),
    "drop_path_rate": float_override("drop_path_rate", "stochastic depth rate"),
    **common_timm_overrides("'avg' (default), 'max', 'avgmax'"),
}
TAGS = {
    "ra2_in1k": "timm hub `timm/nf_resnet50.ra2_in1k` (ImageNet-1k, normaliser-free: DP-ready as it is; default)",
}


def create_nf_resnet(arch: str, **kwargs) -> nn.Module:
    """timm's ``arch`` (``nf_resnet50``) with its configuration's ``depths`` / ``channels`` /
    ``stem_chs`` replaced where given; through timm's own builder, so ``features_only`` works."""
    import timm
    from timm.models import build_model_with_cfg
    from timm.models.nfnet import NormFreeNet, model_cfgs

    changes = {k: kwargs.pop(k) for k in _CFG_KEYS if k in kwargs}
    with timm_rejections(arch, {**kwargs, **changes}):
        if not changes:
            return timm.create_model(arch, **kwargs)
        cfg = dataclasses.replace(
            model_cfgs[arch], **{k: tuple(v) if isinstance(v, list) else v for k, v in changes.items()}
        )
        return build_model_with_cfg(
            NormFreeNet, arch, False, model_cfg=cfg, feature_cfg={"flatten_sequential": True}, **kwargs
        )


_CARD = ModelCard(
    name="nf-resnet50",
    summary="NF-ResNet-50 from timm: normaliser-free (weight-standardised convolutions), DP-ready weights as they are.",
    architecture="timm `nf_resnet50` (ResNet-50 layout, ScaledStdConv2d, no normalisation layers)",
    library="timm",
    task="image-classification",
    patches=(
        "in-place activations replaced by out-of-place ones (safe under backward hooks)",
        "none else needed: no normalisation layer to convert, every convolution and the classifier have biases",
    ),
    weight_source=(
        "random initialisation; `pretrained=True`: timm hub (normaliser-free weights, no conversion: DP-ready as "
        "they are); `weights=PATH`: a local timm checkpoint"
    ),
    pretrained_tags=TAGS,
    license="Apache-2.0 (timm code and weights)",
    papers=(
        "Brock, De & Smith, Characterizing signal propagation to close the performance gap in unnormalized "
        "ResNets, ICLR 2021",
        "De et al., Unlocking High-Accuracy Differentially Private Image Classification through Scale, 2022 "
        "(NFNets for private ImageNet training and fine-tuning)",
    ),
    overrides=card_overrides(OVERRIDES),
    test_overrides={"num_classes": 10, "depths": [1, 1, 1, 1], "channels": [16, 32, 64, 128], "stem_chs": 8},
    example_input={"kind": "image", "shape": [3, 32, 32]},
    notes=(
        "Trained without any normalisation layer, so the pretrained tag is DP-ready as it is: unlike the "
        "ResNets' BatchNorm tags it needs no non-private adaptation before private fine-tuning. The weight "
        "standardisation is part of each convolution's forward; its per-sample gradient (weight, bias and "
        "gain) is exact in every hook mode. Any input size that survives the 4× stem and three 2× "
        "downsamplings works (32×32 and up)."
    ),
)

nf_resnet50 = register_timm_entry(
    _CARD, "nf_resnet50", default_tag="ra2_in1k", overrides_table=OVERRIDES, create=create_nf_resnet
)
