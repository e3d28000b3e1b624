"""nn.InstanceNorm1d/2d/3d with affine=True: y = x̂ · γ_c + β_c, x̂ normalised per sample and
channel over the spatial dims (or by the running statistics, in eval mode with
track_running_stats=True, exactly as the module's forward chooses).

γ: Σ_positions g ⊙ x̂ per channel; β: Σ_positions g, activation-free (DP-BiTFiT Algorithm 1).
Both small: instantiated (Dense). Instance statistics are per sample, so the layer mixes no
samples; running statistics updated in train mode do (the engine refuses that,
:func:`dpzoo.grad_norms.plan.find_problems`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import UnsupportedModuleError
from ..registry import register_rule
from ..reps import Dense

_BATCHED_DIMS = {nn.InstanceNorm1d: 3, nn.InstanceNorm2d: 4, nn.InstanceNorm3d: 5}


def _per_channel_sum(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], x.shape[1], -1).sum(2)


@register_rule(nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, activation_free={"bias"})
def instance_norm_rule(module, activations, grad_output, params):
    out = {}
    if "weight" in params:
        x = activations[0]
        want = next(d for t, d in _BATCHED_DIMS.items() if isinstance(module, t))
        if x.dim() != want:
            raise UnsupportedModuleError(
                f"{type(module).__name__} got an input of shape {tuple(x.shape)}, not a batch of {want - 2}-d "
                "inputs (N, C, ...): per-sample gradients need batch-first inputs."
            )
        input_stats = module.training or not module.track_running_stats
        xhat = F.instance_norm(
            x,
            None if input_stats else module.running_mean,
            None if input_stats else module.running_var,
            None,
            None,
            use_input_stats=input_stats,
            momentum=0.0,
            eps=module.eps,
        )
        out["weight"] = Dense(_per_channel_sum(grad_output * xhat))
    if "bias" in params:
        out["bias"] = Dense(_per_channel_sum(grad_output))
    return out
