"""Declarations about tensors used outside a layer rule: loose tensors and broadcast lookups.

* Loose tensors: trainable tensors a module uses directly in its forward (ViT ``cls_token``,
  ``pos_embed``), each broadcast over the batch from a leading dimension of 1. Only owners
  declared in :data:`LOOSE_TENSORS` (:func:`register_loose_tensors`) get them swapped for
  per-sample copies: the swap is exact only if the code expands the tensor over the batch
  (``cls_token.expand(B, -1, -1)``, ``x + pos_embed``), which dpzoo cannot check.
* Broadcast lookups: Embeddings whose owner looks them up with ids of batch 1 (position ids)
  and adds the result to a (B, ...) tensor (:data:`BROADCAST_LOOKUPS`).
* Functional uses: submodules whose parameters their owner reads directly instead of calling
  the submodule (``nn.MultiheadAttention.out_proj``), so no rule of theirs ever runs
  (:data:`FUNCTIONAL_SUBMODULES`): trainable, they are refused at attach.

The timm registrations (ViT tokens, attention-pool latent) and Hugging Face ViT's embeddings
(``cls_token``, ``position_embeddings``, ``mask_token``) live here too.
"""

from __future__ import annotations

from typing import Callable, Iterable

from torch import nn

from ...errors import UnsupportedModuleError

__all__ = [
    "LOOSE_TENSORS",
    "LOOSE_CHECKS",
    "register_loose_tensors",
    "loose_names",
    "BROADCAST_LOOKUPS",
    "register_broadcast_lookup",
    "is_broadcast_lookup",
    "is_shared_lookup",
    "shared_lookup_refusal",
    "loose_refusal",
    "FUNCTIONAL_SUBMODULES",
    "functional_submodules",
]


LOOSE_TENSORS: dict[type, tuple[str, ...]] = {}

LOOSE_CHECKS: dict[type, Callable[[nn.Module], "str | None"]] = {}


def register_loose_tensors(
    module_type: type, names: Iterable[str], check: Callable[[nn.Module], "str | None"] | None = None
) -> None:
    """Declare that ``module_type`` uses its tensors ``names`` (shape (1, ...), dim ≥ 2) only
    broadcast over the batch, so dpzoo may give each sample its own copy during forward.
    ``check(module)`` returns why a particular instance does not (it is then refused), or None."""
    LOOSE_TENSORS[module_type] = tuple(names)
    if check is not None:
        LOOSE_CHECKS[module_type] = check


def _declared(module: nn.Module) -> type | None:
    for cls in type(module).__mro__:
        if cls in LOOSE_TENSORS:
            return cls
    return None


def loose_refusal(module: nn.Module) -> str | None:
    """Why the module's declared loose tensors cannot be swapped for this instance (its declaration's
    check), or None (none declared, or the check passes)."""
    cls = _declared(module)
    check = LOOSE_CHECKS.get(cls) if cls is not None else None
    why = check(module) if check is not None else None
    return f"{type(module).__name__}: {why}." if why else None


def loose_names(module: nn.Module) -> tuple[str, ...]:
    """The loose tensors declared for the module's nearest registered class (raises if its check
    refuses this instance); () if none is declared."""
    cls = _declared(module)
    if cls is None:
        return ()
    why = loose_refusal(module)
    if why:
        raise UnsupportedModuleError(why)
    return LOOSE_TENSORS[cls]


def _timm_vit_check(module: nn.Module) -> str | None:
    if getattr(module, "dynamic_img_size", False):
        return (
            "dynamic_img_size=True resamples pos_embed as a (1, ...) tensor, which per-sample copies "
            "cannot follow; build the ViT with dynamic_img_size=False (a fixed image size)"
        )
    return None


try:  # timm's Vision Transformers: cls_token, pos_embed, reg_token, broadcast in _pos_embed
    from timm.models.vision_transformer import VisionTransformer as _TimmViT

    register_loose_tensors(_TimmViT, ("cls_token", "pos_embed", "reg_token"), check=_timm_vit_check)
except ImportError:  # pragma: no cover
    pass

try:  # timm's attention pooling (global_pool="map"): latent.expand(B, -1, -1)
    from timm.layers.attention_pool import AttentionPoolLatent as _TimmAttnPool

    register_loose_tensors(_TimmAttnPool, ("latent",))
except ImportError:  # pragma: no cover
    pass


try:  # Hugging Face ViT: cls_token.expand(B, -1, -1), mask_token.expand(B, T, -1), x + position_embeddings
    from transformers.models.vit.modeling_vit import ViTEmbeddings as _HFViTEmbeddings

    # forward(interpolate_pos_encoding=True) at another image size reshapes position_embeddings as
    # (1, ...): with per-sample copies (B > 1) torch then raises (a shape error), nothing silent
    register_loose_tensors(_HFViTEmbeddings, ("cls_token", "mask_token", "position_embeddings"))
except ImportError:  # pragma: no cover
    pass


# Owners that read a submodule's parameters directly (F.multi_head_attention_forward takes
# out_proj.weight and out_proj.bias; out_proj is never called): no rule of the submodule runs.
FUNCTIONAL_SUBMODULES: dict[type, tuple[str, ...]] = {nn.MultiheadAttention: ("out_proj",)}


def functional_submodules(module: nn.Module) -> tuple[str, ...]:
    """Names of the submodules whose parameters ``module`` uses without calling them."""
    for cls in type(module).__mro__:
        if cls in FUNCTIONAL_SUBMODULES:
            return FUNCTIONAL_SUBMODULES[cls]
    return ()


# Embeddings whose owner looks them up with ids of batch 1 (position ids) and adds the result
# to a (B, ...) tensor, i.e. broadcasts it over the batch: dpzoo gives every sample its own
# lookup (exact). Declared per owner: elsewhere a (1, ...) lookup may mean anything (T5's
# (Q, K) relative-position ids with Q = 1, `emb(ids[None])[0]`) and is refused by the batch
# check instead. Keys: (module path, class name) so transformers is never imported for it.
BROADCAST_LOOKUPS: dict[tuple[str, str], tuple[str, ...]] = {
    ("transformers.models.gpt2.modeling_gpt2", "GPT2Model"): ("wpe",),
    ("transformers.models.bert.modeling_bert", "BertEmbeddings"): ("position_embeddings",),
    ("transformers.models.roberta.modeling_roberta", "RobertaEmbeddings"): ("position_embeddings",),
    ("transformers.models.distilbert.modeling_distilbert", "Embeddings"): ("position_embeddings",),
    ("transformers.models.albert.modeling_albert", "AlbertEmbeddings"): ("position_embeddings",),
    ("transformers.models.clip.modeling_clip", "CLIPTextEmbeddings"): ("position_embedding",),
    ("transformers.models.gpt_neo.modeling_gpt_neo", "GPTNeoModel"): ("wpe",),
}


def register_broadcast_lookup(owner_type: type, names: Iterable[str]) -> None:
    """Declare that ``owner_type`` looks its Embeddings ``names`` up with batch-1 ids and only
    broadcasts the result over the batch (so each sample may get its own lookup)."""
    BROADCAST_LOOKUPS[(owner_type.__module__, owner_type.__qualname__)] = tuple(names)


def is_broadcast_lookup(owner: nn.Module | None, attr: str) -> bool:
    """Whether ``owner`` declares its submodule ``attr`` a broadcast lookup."""
    return _listed_for(BROADCAST_LOOKUPS, owner, attr)


def _listed_for(table: dict[tuple[str, str], tuple[str, ...]], owner: nn.Module | None, attr: str) -> bool:
    """Whether ``owner``'s class, or one it inherits from, lists ``attr`` in ``table``."""
    if owner is None:
        return False
    return any(attr in table.get((c.__module__, c.__qualname__), ()) for c in type(owner).__mro__)


# Embeddings looked up once for the whole batch, with no batch dimension at all: T5's relative
# position buckets (query, key) -> bias per head, added to every sample's attention scores. Their
# gradient is summed over the batch before any hook sees it, so no per-sample gradient can be
# taken; decided by module, never by shape (when T equals B the ids look batch-first).
SHARED_LOOKUPS: dict[tuple[str, str], tuple[str, ...]] = {
    ("transformers.models.t5.modeling_t5", "T5Attention"): ("relative_attention_bias",),
    ("transformers.models.mt5.modeling_mt5", "MT5Attention"): ("relative_attention_bias",),
    ("transformers.models.umt5.modeling_umt5", "UMT5Attention"): ("relative_attention_bias",),
    ("transformers.models.longt5.modeling_longt5", "LongT5Attention"): ("relative_attention_bias",),
    ("transformers.models.longt5.modeling_longt5", "LongT5LocalAttention"): ("relative_attention_bias",),
    ("transformers.models.longt5.modeling_longt5", "LongT5TransientGlobalAttention"): (
        "relative_attention_bias",
        "global_relative_attention_bias",
    ),
    ("transformers.models.switch_transformers.modeling_switch_transformers", "SwitchTransformersAttention"): (
        "relative_attention_bias",
    ),
}
SHARED_LOOKUP_NAMES = ("relative_attention_bias", "global_relative_attention_bias")  # any other owner too


def is_shared_lookup(owner: nn.Module | None, attr: str) -> bool:
    """Whether ``owner`` looks its submodule ``attr`` up once for the whole batch (a position
    table with no batch dimension: no per-sample gradient)."""
    if owner is not None and attr in SHARED_LOOKUP_NAMES:
        return True
    return _listed_for(SHARED_LOOKUPS, owner, attr)


def shared_lookup_refusal(owner: nn.Module | None, attr: str, what: str, path: str) -> str | None:
    """The refusal of ``owner``'s submodule ``attr`` (``what``, at ``path`` in the model) if it is a
    shared lookup (:func:`is_shared_lookup`), else None."""
    if not is_shared_lookup(owner, attr):
        return None
    return (
        f"Module {what} is a position table looked up once for the whole batch (no batch dimension): its gradient "
        f"is shared by every sample and cannot be clipped per sample. Freeze it: "
        f"model.get_submodule('{path}').requires_grad_(False)."
    )
