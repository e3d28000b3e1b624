"""nn.Linear: y = x Wᵀ + b, x: (B, ..., in). Weight: factored (BK eq. 2); bias: Σ_t g_t,
activation-free (DP-BiTFiT Algorithm 1)."""

from __future__ import annotations

from torch import nn

from ..registry import register_rule
from ..reps import Dense, Factored
from ._util import sum_all_but, tokens_last


@register_rule(nn.Linear, activation_free={"bias"}, half_factors=True)
def linear_rule(module: nn.Linear, activations, grad_output, params):
    out = {}
    if "weight" in params:
        a = tokens_last(activations[0])
        g = tokens_last(grad_output)
        out["weight"] = Factored(g.unsqueeze(1), a.unsqueeze(1), tuple(module.weight.shape))
    if "bias" in params:
        out["bias"] = Dense(sum_all_but(grad_output, 1))
    return out


try:  # timm's Linear: nn.Linear whose forward casts the weight only under torch.jit scripting
    from timm.layers.linear import Linear as TimmLinear
except ImportError:  # pragma: no cover
    TimmLinear = None
if TimmLinear is not None:
    register_rule(TimmLinear, activation_free={"bias"}, half_factors=True)(linear_rule)
