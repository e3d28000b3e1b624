"""nn.PReLU: y = max(0, x) + a · min(0, x), with one slope (num_parameters=1) or one per channel
(dim 1 of a batch-first input). The slope's per-sample gradient is Σ g ⊙ min(0, x) over the
sample's elements (per channel with num_parameters = C): small, instantiated (Dense)."""

from __future__ import annotations

import torch
from torch import nn

from ...errors import UnsupportedModuleError
from ..registry import register_rule
from ..reps import Dense


@register_rule(nn.PReLU, params=("weight",))
def prelu_rule(module: nn.PReLU, activations, grad_output, params):
    x = activations[0]
    b = grad_output.shape[0]
    neg = grad_output * torch.clamp(x, max=0)
    n = module.weight.numel()
    if n == 1:
        return {"weight": Dense(neg.reshape(b, -1).sum(1).reshape(b, *module.weight.shape))}
    if x.dim() < 2 or x.shape[1] != n:
        raise UnsupportedModuleError(
            f"PReLU with {n} slopes got an input of shape {tuple(x.shape)}: per-sample gradients need a "
            "batch-first input (N, C, ...) with its channels in dim 1."
        )
    return {"weight": Dense(neg.reshape(b, n, -1).sum(2))}
