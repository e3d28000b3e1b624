"""Vision Transformers from timm. LayerNorm and biases are already present; dpzoo only
checks for in-place ops. Its ``cls_token`` and ``pos_embed`` are parameters the model
owns directly: the per-sample-norm hooks cover them with their own rules."""

from __future__ import annotations

from ..registry import ModelCard
from ._common import card_overrides
from ._timm import float_override, int_override, register_timm_entry

OVERRIDES = {
    "num_classes": int_override("num_classes", "classifier outputs (default 1000)"),
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
        pretrained_tags={tag: f"timm hub `timm/{arch}.{tag}` (ImageNet-21k, fine-tuned on 1k)"},
        license="Apache-2.0 (timm code and weights)",
        papers=(
            "Dosovitskiy et al., An Image is Worth 16x16 Words, ICLR 2021",
            "Bu et al., DP-BiTFiT, ICML 2024: Table 1 (bias share of ViT parameters)",
        ),
        overrides=card_overrides(OVERRIDES),
        test_overrides={"num_classes": 10, "img_size": 32, "patch_size": 8, "depth": 2, "width": 32, "num_heads": 2},
        example_input={"kind": "image", "shape": [3, 32, 32]},
        notes="`cls_token` and `pos_embed` are trainable tensors owned by the model itself, not by a layer.",
    )

    return register_timm_entry(card, arch, default_tag=tag, overrides_table=OVERRIDES)


vit_tiny_patch16 = _builder("tiny")
vit_small_patch16 = _builder("small")
vit_base_patch16 = _builder("base")
