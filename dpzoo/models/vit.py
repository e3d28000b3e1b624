"""Vision Transformers from timm. LayerNorm and biases are already present; dpzoo only
checks for in-place ops. Its ``cls_token`` and ``pos_embed`` are parameters the model
owns directly: the per-sample-norm hooks cover them with their own rules."""

from __future__ import annotations

from typing import Any

from ..errors import OverrideError
from ..registry import ModelCard
from ._common import Override, card_overrides
from ._timm import common_timm_overrides, float_override, int_override, register_timm_entry


def _no_feature_getter(value: Any) -> dict[str, Any]:
    if value is False:
        return {}
    raise OverrideError(
        "features_only=True is not offered for ViT: timm's FeatureGetterNet calls forward_intermediates, which "
        "bypasses the forward that gives each sample its own cls_token and pos_embed, so their per-sample "
        "gradients could not be accounted for. Use num_classes=0 (pooled features) or global_pool instead."
    )


OVERRIDES = {
    "num_classes": int_override(
        "num_classes",
        "classifier outputs (default 1000); 0: no classifier (pooled features, timm's convention)",
        minimum=0,
    ),
    "img_size": int_override(
        "img_size", "input resolution (default 224); position embeddings are resampled when loading weights"
    ),
    "patch_size": int_override("patch_size", "patch size (default 16)"),
    "in_chans": int_override("in_chans", "input channels (default 3)"),
    "depth": int_override("depth", "number of Transformer blocks"),
    "width": int_override("width", "embedding dimension", target="embed_dim"),
    "num_heads": int_override("num_heads", "attention heads"),
    "mlp_ratio": float_override("mlp_ratio", "MLP hidden size / width (default 4)", lo=0.01, hi=64),
    "drop_rate": float_override("drop_rate", "dropout rate"),
    "drop_path_rate": float_override("drop_path_rate", "stochastic depth rate"),
    "attn_drop_rate": float_override("attn_drop_rate", "dropout on attention weights"),
    "proj_drop_rate": float_override("proj_drop_rate", "dropout after the attention and MLP projections"),
    "pos_drop_rate": float_override("pos_drop_rate", "dropout after adding position embeddings"),
    **common_timm_overrides(
        "'token' (default), 'avg', 'max', 'avgmax', 'map' (attention pooling: adds a trainable `latent`, "
        "handled), '' (none)",
        features=False,
    ),
    "features_only": Override("not offered for ViT (see the notes); False is accepted", _no_feature_getter),
}
_SIZES = {"tiny": (192, 3), "small": (384, 6), "base": (768, 12)}


def _builder(size: str):
    name, arch = f"vit-{size}-patch16", f"vit_{size}_patch16_224"
    tag = "augreg_in21k_ft_in1k"
    width, heads = _SIZES[size]
    card = ModelCard(
        name=name,
        summary=f"ViT-{size.capitalize()}/16 (width {width}, {heads} heads, 12 blocks) from timm; LayerNorm and biases already DP-friendly.",
        architecture=f"timm `{arch}`",
        library="timm",
        task="image-classification",
        patches=(
            "none needed: LayerNorm, every Linear and the patch-embedding Conv2d have biases",
            "in-place ops switched off where a module offers the switch",
        ),
        weight_source="random initialisation; `pretrained=True`: timm hub; `weights=PATH`: a local timm checkpoint",
        pretrained_tags={
            tag: f"timm hub `timm/{arch}.{tag}` (ImageNet-21k, fine-tuned on 1k; LayerNorm: DP-ready as it is)"
        },
        license="Apache-2.0 (timm code and weights)",
        papers=(
            "Dosovitskiy et al., An Image is Worth 16x16 Words, ICLR 2021",
            "Bu et al., DP-BiTFiT, ICML 2024: Table 1 (bias share of ViT parameters)",
        ),
        overrides=card_overrides(OVERRIDES),
        test_overrides={"num_classes": 10, "img_size": 32, "patch_size": 8, "depth": 2, "width": 32, "num_heads": 2},
        example_input={"kind": "image", "shape": [3, 32, 32]},
        notes=(
            "`cls_token` and `pos_embed` are trainable tensors owned by the model itself, not by a layer. "
            "timm's `features_only` is not offered: its `FeatureGetterNet` calls `forward_intermediates`, "
            "not the forward through which dpzoo gives each sample its own copy of `cls_token` and "
            "`pos_embed`, so their per-sample gradients would be unaccounted for (dpzoo's hooks refuse such "
            "a model). Use the classifier with `global_pool` or `num_classes=0` for features instead."
        ),
    )

    return register_timm_entry(card, arch, default_tag=tag, overrides_table=OVERRIDES)


vit_tiny_patch16 = _builder("tiny")
vit_small_patch16 = _builder("small")
vit_base_patch16 = _builder("base")
