"""Hugging Face decoder layers that keep tokens batch-first, for per-sample gradients.

transformers' ``OPTDecoderLayer`` flattens its hidden states to (B·T, d) before its feed-forward
(``final_layer_norm``, ``fc1``, ``fc2``) and restores (B, T, d) after: those layers never see the
batch in dim 0, so dpzoo's hooks refuse them (which row belongs to which sample is lost). LayerNorm
and Linear act on the last dim only, so :class:`DPOPTDecoderLayer` computes the same function
without the reshape; dpzoo swaps it in by class (``layer.__class__ = DPOPTDecoderLayer``, every
parameter kept, pickling works). The forward mirrors one version of transformers' code: the swap
happens only when the installed ``OPTDecoderLayer.forward`` is that version
(:func:`mirrors_installed`), and the tests compare both in float64.
"""

from __future__ import annotations

import hashlib
import inspect

import torch
import torch.nn.functional as F
from transformers.models.opt.modeling_opt import OPTDecoderLayer

__all__ = ["DPOPTDecoderLayer", "mirrors_installed", "FLATTENING_BLOCKS", "flattened_submodules"]

# sha256 of the source of the forward each class mirrors (transformers 5.x OPTDecoderLayer.forward)
_MIRRORED = {OPTDecoderLayer: "9d8d1897a2c4f3d24d8dd364cd675a05713bba93878b28fb6bb0ff9cde60c30f"}


def mirrors_installed(cls: type[torch.nn.Module]) -> bool:
    """Whether dpzoo's batch-first copy of ``cls.forward`` was written from the installed source."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return hashlib.sha256(source.encode()).hexdigest() == _MIRRORED.get(cls)


class DPOPTDecoderLayer(OPTDecoderLayer):
    """``OPTDecoderLayer`` whose feed-forward runs on (B, T, d), not on flattened (B·T, d) tokens."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values=None,
        use_cache: bool | None = False,
        position_ids: torch.LongTensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        residual = hidden_states
        if self.do_layer_norm_before:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            past_key_values=past_key_values,
            position_ids=position_ids,
            attention_mask=attention_mask,
            **kwargs,
        )
        hidden_states = F.dropout(hidden_states, p=self.dropout, training=self.training)
        hidden_states = residual + hidden_states
        if not self.do_layer_norm_before:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        residual = hidden_states  # (B, T, d): no reshape to (B·T, d)
        if self.do_layer_norm_before:
            hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = self.fc2(self.activation_fn(self.fc1(hidden_states)))
        hidden_states = F.dropout(hidden_states, p=self.dropout, training=self.training)
        hidden_states = residual + hidden_states
        if not self.do_layer_norm_before:
            hidden_states = self.final_layer_norm(hidden_states)
        return hidden_states


# class -> its batch-first replacement (swapped by class, see dpzoo.surgery.layers)
FLATTENING_BLOCKS: dict[type, type] = {OPTDecoderLayer: DPOPTDecoderLayer}


def flattened_submodules(module) -> tuple[str, ...]:
    """Names of the submodules ``module`` (exactly a class of :data:`FLATTENING_BLOCKS`) calls on
    flattened (B·T, d) tokens; () for any other module."""
    if type(module) is OPTDecoderLayer:
        return ("final_layer_norm", "fc1", "fc2") if module.do_layer_norm_before else ("fc1", "fc2")
    return ()
