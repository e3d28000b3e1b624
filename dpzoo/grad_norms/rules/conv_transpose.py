"""nn.ConvTranspose1d/2d/3d with any stride, padding, output_padding, dilation and groups.

A transposed convolution is the adjoint of the convolution with the same weight, stride,
padding, dilation and groups: ``y = conv_transpose(x, W)`` satisfies ⟨y, g⟩ = ⟨x, conv(g, W)⟩.
So the weight's per-sample gradient is the *convolution's* weight gradient with the roles of
input and output swapped: Σ_t x_t ⊗ patches(g)_t over the T input positions, where the patches
of the output gradient g are unfolded with the module's kernel, stride, dilation and zero padding
(BK paper §3.1, factored per group). ``output_padding`` only adds output positions no input
position reaches besides the ones covered: the windows are read off g's actual shape (which also
covers ``forward(x, output_size=...)``) and the first ∏ input-size ones kept.
"""

from __future__ import annotations

import torch
from torch import nn

from ...errors import UnsupportedModuleError
from ..registry import register_rule
from ..reps import Dense, Factored
from .conv import grad_by_group, unfold_patches


def _tuple(v, nd: int) -> tuple:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * nd


@register_rule(nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d, activation_free={"bias"})
def conv_transpose_rule(module, activations, grad_output, params):
    out = {}
    if "weight" in params:
        x = activations[0]
        if not isinstance(x, torch.Tensor) or x.dim() != module.weight.dim():
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise UnsupportedModuleError(
                f"{type(module).__name__} got an input {shape} that is not a batch (N, C, ...) of the "
                f"transposed convolution's {module.weight.dim() - 2}-d inputs: per-sample gradients need "
                "batch-first inputs."
            )
        nd = x.dim() - 2
        padding = _tuple(module.padding, nd)
        pad = [p for i in reversed(range(nd)) for p in (padding[i], padding[i])]
        # the adjoint convolution reads g (C_out channels) and produces x (C_in channels)
        right = unfold_patches(grad_output, module, pad, "constant", positions=tuple(x.shape[2:]))
        left = grad_by_group(x, module.groups)  # (B, G, T, C_in / G)
        if left.shape[:3] != right.shape[:3] or left.shape[3] * right.shape[3] * module.groups != module.weight.numel():
            raise UnsupportedModuleError(
                f"{type(module).__name__}: the transposed convolution dpzoo reconstructs from the module's "
                f"attributes (padding, stride, dilation, groups, kernel) covers {right.shape[2]} input positions "
                f"per sample, the input has {left.shape[2]}: the module does not compute what the rule assumes."
            )
        out["weight"] = Factored(left, right, tuple(module.weight.shape))
    if "bias" in params:
        out["bias"] = Dense(grad_output.reshape(grad_output.shape[0], grad_output.shape[1], -1).sum(2))
    return out
