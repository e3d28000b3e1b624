"""nn.Conv1d/2d/3d with any stride, padding (and padding mode), dilation and groups.

The input is padded exactly as the module pads it and unfolded into patches, so the
convolution is a linear layer over T = ∏ output positions: the weight's per-sample gradient
is factored per group, (grad_output, patches) (BK paper §3.1: T is H_out·W_out).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..registry import register_rule
from ..reps import Dense, Factored


def _patches(x: torch.Tensor, module: nn.Module, pad: list[int] | None, mode: str) -> torch.Tensor:
    """(B, C, *spatial) → (B, G, T, C/G · ∏k), patches in the order of the weight's dims."""
    nd = x.dim() - 2
    if pad is not None and any(pad):
        x = F.pad(x, pad, mode=mode) if mode != "constant" else F.pad(x, pad)
    for i in range(nd):
        k, s, d = module.kernel_size[i], module.stride[i], module.dilation[i]
        x = x.unfold(2 + i, (k - 1) * d + 1, s)  # window dims appended at the end
        if d > 1:
            x = x[..., ::d]
    b, c = x.shape[:2]
    t = math.prod(x.shape[2:2 + nd])
    k = math.prod(module.kernel_size)
    g = module.groups
    x = x.reshape(b, g, c // g, t, k).permute(0, 1, 3, 2, 4)
    return x.reshape(b, g, t, (c // g) * k)


def _grad_by_group(grad_output: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, out, *spatial) → (B, G, T, out/G)."""
    b, o = grad_output.shape[:2]
    return grad_output.reshape(b, groups, o // groups, -1).transpose(2, 3)


def _module_padding(module: nn.Module) -> tuple[list[int], str]:
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    return list(module._reversed_padding_repeated_twice), mode


def _conv_rule(module, activations, grad_output, params, pad_fn=_module_padding):
    out = {}
    if "weight" in params:
        x = activations[0]
        if x.dim() == module.weight.dim() - 1:
            from ...errors import UnsupportedModuleError
            raise UnsupportedModuleError(
                f"{type(module).__name__} got an unbatched input {tuple(x.shape)}: per-sample gradients "
                "need batch-first inputs (N, C, ...).")
        pad, mode = pad_fn(module) if pad_fn is _module_padding else pad_fn(module, x)
        patches = _patches(x, module, pad, mode)
        g = _grad_by_group(grad_output, module.groups)
        out["weight"] = Factored(g, patches, tuple(module.weight.shape))
    if "bias" in params:
        out["bias"] = Dense(grad_output.reshape(grad_output.shape[0], grad_output.shape[1], -1).sum(2))
    return out


@register_rule(nn.Conv1d, nn.Conv2d, nn.Conv3d, activation_free={"bias"})
def conv_rule(module, activations, grad_output, params):
    return _conv_rule(module, activations, grad_output, params)


try:  # timm's Conv2dSame pads inside forward ('SAME' padding of TF-ported weights)
    from timm.layers.conv2d_same import Conv2dSame
    from timm.layers.padding import get_same_padding
except ImportError:  # pragma: no cover
    Conv2dSame = None

if Conv2dSame is not None:
    def _same_padding(module, x):
        ih, iw = x.shape[-2:]
        ph = get_same_padding(ih, module.kernel_size[0], module.stride[0], module.dilation[0])
        pw = get_same_padding(iw, module.kernel_size[1], module.stride[1], module.dilation[1])
        return [pw // 2, pw - pw // 2, ph // 2, ph - ph // 2], "constant"

    @register_rule(Conv2dSame, activation_free={"bias"})
    def conv2d_same_rule(module, activations, grad_output, params):
        return _conv_rule(module, activations, grad_output, params, pad_fn=_same_padding)
