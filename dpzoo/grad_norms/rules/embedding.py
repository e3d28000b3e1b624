"""nn.Embedding: the per-sample gradient of the table is onehot(ids)ᵀ · grad_output.
Positions holding ``padding_idx`` get no gradient (as in torch's backward)."""

from __future__ import annotations

from torch import nn

from ..registry import register_rule
from ..reps import OneHot


def _check(module: nn.Embedding) -> str | None:
    if module.max_norm is not None:
        return "max_norm renormalises rows in place during forward"
    if module.scale_grad_by_freq:
        return "scale_grad_by_freq scales gradients by batch-wide counts, mixing samples"
    if module.sparse:
        return "sparse gradients are not supported"
    return None


@register_rule(nn.Embedding, params=("weight",), check=_check)
def embedding_rule(module: nn.Embedding, activations, grad_output, params):
    ids = activations[0]
    ids = ids.reshape(ids.shape[0], -1)
    g = grad_output.reshape(grad_output.shape[0], -1, grad_output.shape[-1])
    if module.padding_idx is not None:
        g = g * (ids != module.padding_idx).unsqueeze(-1).to(g.dtype)
    return {"weight": OneHot(ids, g, module.num_embeddings)}
