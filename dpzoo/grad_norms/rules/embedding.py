"""nn.Embedding: the per-sample gradient of the table is onehot(ids)ᵀ · grad_output.
Positions holding ``padding_idx`` get no gradient (as in torch's backward)."""

from __future__ import annotations

from torch import nn

from ..registry import register_rule
from ..reps import OneHot


def embedding_check(module: nn.Embedding) -> str | None:
    """Why an Embedding cannot get exact per-sample gradients (renormalised rows, batch-wide
    gradient scaling, sparse gradients), or None."""
    if module.max_norm is not None:
        return "max_norm renormalises rows in place during forward"
    if module.scale_grad_by_freq:
        return "scale_grad_by_freq scales gradients by batch-wide counts, mixing samples"
    if module.sparse:
        return "sparse gradients are not supported"
    return None


def lookup_rep(ids, grad_output, num_rows: int, padding_idx: int | None) -> OneHot:
    """The per-sample gradient of a (num_rows, d) table looked up with ``ids`` (B, ...)."""
    ids = ids.reshape(ids.shape[0], -1)
    g = grad_output.reshape(grad_output.shape[0], -1, grad_output.shape[-1])
    if padding_idx is not None:
        g = g * (ids != padding_idx).unsqueeze(-1).to(g.dtype)
    return OneHot(ids, g, num_rows)


@register_rule(nn.Embedding, params=("weight",), check=embedding_check)
def embedding_rule(module: nn.Embedding, activations, grad_output, params):
    return {"weight": lookup_rep(activations[0], grad_output, module.num_embeddings, module.padding_idx)}
