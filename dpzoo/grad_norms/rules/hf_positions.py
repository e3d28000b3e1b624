"""transformers' OPTLearnedPositionalEmbedding: an nn.Embedding whose forward takes the attention
mask (and the cache length), not ids, and looks up ``cumsum(mask) · mask − 1 + offset``.

It overrides ``nn.Embedding.forward``, so the Embedding rule does not apply to it (the registry's
override check, :mod:`dpzoo.grad_norms.registry`); this rule is registered for the class itself and
recomputes the ids exactly as its forward does, from the recorded positional inputs
``(attention_mask, past_key_values_length[, position_ids])``, then is the Embedding rule
(one-hot, :class:`~dpzoo.grad_norms.reps.OneHot`). Every sample's positions come from its own
mask row, so the lookup is per sample. The ids must be those the module looked up:
``position_ids`` passed by keyword are not recorded (OPTDecoder computes them from the same mask,
the same way, unless the caller passes its own ``position_ids`` to the model: then the engine's
first-step self-check compares with single-sample passes).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ...errors import UnsupportedModuleError
from ..registry import register_rule
from .embedding import embedding_check, lookup_rep

try:
    from transformers.models.opt.modeling_opt import OPTLearnedPositionalEmbedding
except ImportError:  # pragma: no cover - transformers is a dependency
    OPTLearnedPositionalEmbedding = None

# OPT's forward ends in nn.Embedding.forward (super().forward(ids)): the rule relies on it too
_EMBEDDING_FORWARD = inspect.getattr_static(nn.Embedding, "forward")


def opt_positions_check(module) -> str | None:
    """Why an OPT positional embedding cannot get the rule (an Embedding's reasons, or a replaced
    nn.Embedding.forward), or None."""
    if inspect.getattr_static(nn.Embedding, "forward") is not _EMBEDDING_FORWARD:
        return "nn.Embedding.forward, which its forward calls, was replaced after dpzoo's rules were registered"
    return embedding_check(module)


def opt_position_ids(module, activations) -> torch.Tensor:
    """The ids the module looked up, from its positional inputs, as its forward computes them."""
    mask = activations[0]
    past = activations[1] if len(activations) > 1 else 0
    positions = activations[2] if len(activations) > 2 else None
    if positions is None:
        positions = (torch.cumsum(mask, dim=1) * mask - 1).long()[:, past:]
    return positions + module.offset


if OPTLearnedPositionalEmbedding is not None:

    @register_rule(OPTLearnedPositionalEmbedding, params=("weight",), check=opt_positions_check)
    def opt_positions_rule(module, activations, grad_output, params):
        ids = opt_position_ids(module, activations)
        if tuple(ids.shape) != tuple(grad_output.shape[:-1]):
            raise UnsupportedModuleError(
                f"{type(module).__name__}: the positions dpzoo recomputes from its attention mask have shape "
                f"{tuple(ids.shape)}, its output {tuple(grad_output.shape[:-1])}: pass past_key_values_length "
                "positionally (as OPTDecoder does), so the rule sees the ids the module looked up."
            )
        return {"weight": lookup_rep(ids, grad_output, module.num_embeddings, module.padding_idx)}
