"""transformers' Conv1D (GPT-2): y = x W + b with W: (in, out)."""

from __future__ import annotations

from ..registry import register_rule
from ..reps import Dense, Factored
from ._util import sum_all_but, tokens_last

try:
    from transformers.pytorch_utils import Conv1D
except ImportError:  # pragma: no cover - transformers is a dependency
    Conv1D = None

if Conv1D is not None:

    @register_rule(Conv1D, activation_free={"bias"}, half_factors=True)
    def hf_conv1d_rule(module, activations, grad_output, params):
        out = {}
        if "weight" in params:
            a = tokens_last(activations[0])
            g = tokens_last(grad_output)
            out["weight"] = Factored(a.unsqueeze(1), g.unsqueeze(1), tuple(module.weight.shape))
        if "bias" in params:
            out["bias"] = Dense(sum_all_but(grad_output, 1))
        return out
