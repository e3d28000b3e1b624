"""dpzoo's DP-ready attention pieces (:mod:`dpzoo.nn.attention`): :class:`SequenceBias` appends a
learned vector as the last key/value position, so its per-sample gradient is the output gradient
at that position, g[:, -1] (activation-free). The projections of
:class:`~dpzoo.nn.DPMultiheadAttention` are plain ``nn.Linear`` (the Linear rule)."""

from __future__ import annotations

from ...nn.attention import SequenceBias
from ..registry import register_rule
from ..reps import Dense


@register_rule(SequenceBias, params=("bias",), activation_free={"bias"})
def sequence_bias_rule(module: SequenceBias, activations, grad_output, params):
    return {"bias": Dense(grad_output[:, -1])}
