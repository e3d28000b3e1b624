"""nn.Conv1d/2d/3d with any stride, padding (and padding mode), dilation and groups; timm's
Conv2dSame and its weight-standardised convolutions (StdConv2d, ScaledStdConv2d and their
'SAME' variants).

The input is padded exactly as the module pads it and unfolded into patches, so the
convolution is a linear layer over T = ∏ output positions: the weight's per-sample gradient
is factored per group, (grad_output, patches) (BK paper §3.1: T is H_out·W_out). The patches
(∏k × the input) are formed only when a path reads them (:class:`~dpzoo.grad_norms.reps.LazyFactored`):
on a CPU, a use on the instantiation path with at least GROUPED_MIN_POSITIONS output positions per
input channel (of a group) gets its per-sample gradients from one convolution with the batch folded
into its groups instead.

The rule mirrors ``_ConvNd._conv_forward`` from the module's *current* attributes: zero padding
comes from ``module.padding`` (what ``F.conv*d`` gets), other padding modes from
``_reversed_padding_repeated_twice`` (what ``F.pad`` gets), the kernel size from the weight.
It relies on ``forward`` and ``_conv_forward``: a subclass overriding either gets no rule
(:mod:`dpzoo.grad_norms.registry`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.conv import _ConvNd

from ...errors import UnsupportedModuleError
from ..half import exact_matmuls, launches_kernels, upcast
from ..registry import register_rule
from ..reps import Dense, LazyFactored, instantiate


def _tuple(v, nd: int) -> tuple:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * nd


def unfold_patches(
    x: torch.Tensor, module, pad: list[int] | None, mode: str, positions: tuple[int, ...] | None = None
) -> torch.Tensor:
    """(B, C, *spatial) → (B, G, T, C/G · ∏k): the patches a convolution with ``module``'s kernel
    (its weight's trailing dims), stride, dilation and groups sees, in the order of the weight's
    dims. ``positions``: keep only the first n windows along each spatial dim (transposed
    convolutions with ``output_padding``)."""
    return _patches(x, pad, mode, module, positions)


def _padded(x: torch.Tensor, pad: list[int] | None, mode: str) -> torch.Tensor:
    if pad is not None and any(pad):
        return F.pad(x, pad, mode=mode) if mode != "constant" else F.pad(x, pad)
    return x


def _windows(x: torch.Tensor, module, positions: tuple[int, ...] | None = None) -> torch.Tensor:
    """(B, C, *spatial) padded → (B, C, *positions, *kernel): a view, nothing copied."""
    nd = x.dim() - 2
    kernel = tuple(module.weight.shape[2:])
    stride, dilation = _tuple(module.stride, nd), _tuple(module.dilation, nd)
    for i in range(nd):
        k, s, d = kernel[i], stride[i], dilation[i]
        x = x.unfold(2 + i, (k - 1) * d + 1, s)  # window dims appended at the end
        if d > 1:
            x = x[..., ::d]
        if positions is not None:
            x = x.narrow(2 + i, 0, min(positions[i], x.shape[2 + i]))
    return x


def _patches_shape(x: torch.Tensor, pad: list[int] | None, module) -> tuple[int, int, int, int]:
    """(B, G, T, C/G · ∏k) of the patches of ``x`` padded by ``pad``, without forming either."""
    w = module.weight
    nd = w.dim() - 2
    stride, dilation = _tuple(module.stride, nd), _tuple(module.dilation, nd)
    t, kernel = 1, 1
    for i in range(nd):  # a loop: no generator frame per convolution, every step
        size = x.shape[2 + i] + (pad[2 * (nd - 1 - i)] + pad[2 * (nd - 1 - i) + 1] if pad else 0)
        # no window fits: 0 (a product of two negative counts could match the real output)
        t *= max((size - dilation[i] * (w.shape[2 + i] - 1) - 1) // stride[i] + 1, 0)
        kernel *= w.shape[2 + i]
    return x.shape[0], module.groups, t, (x.shape[1] // module.groups) * kernel


def _channels_last_padded(x: torch.Tensor, pad: list[int] | None, mode: str) -> torch.Tensor:
    """:func:`_padded` with the channels innermost in memory (the (B, C, *spatial) view of a
    channels-last tensor): zero padding is one zeroed buffer and one copy of the input into it."""
    if mode != "constant" or not pad or min(pad) < 0:
        return _padded(x, pad, mode).movedim(1, -1).contiguous().movedim(-1, 1)
    nd = x.dim() - 2
    lo = [pad[2 * (nd - 1 - i)] for i in range(nd)]  # F.pad lists the last dimension first
    hi = [pad[2 * (nd - 1 - i) + 1] for i in range(nd)]
    out = x.new_zeros(x.shape[0], *[x.shape[2 + i] + lo[i] + hi[i] for i in range(nd)], x.shape[1])
    inside = (slice(None),) + tuple(slice(lo[i], lo[i] + x.shape[2 + i]) for i in range(nd))
    out[inside] = x.movedim(1, -1)
    return out.movedim(-1, 1)


def _patches(x: torch.Tensor, pad: list[int] | None, mode: str, module, positions=None) -> torch.Tensor:
    """The windows of ``x`` padded as the module pads it, as (B, G, T, C/G · ∏k) rows: the copy
    (k× the input) the products need. On a CPU in two steps, the same values: the windows gathered
    with the channels innermost (from a channels-last copy of the padded input), then each row's
    (∏k, C) block transposed. Gathering straight into (C, ∏k) order copies k values at a time (a
    3×3 kernel: runs of 3), which on 2 cores took 2.5-5× as long for ResNet-18-GN's 3×3 layers at
    32² (2026-11-28, both routes timed on the same shapes); a transient second copy of the rows is
    the price."""
    kernel = math.prod(module.weight.shape[2:])
    g = module.groups
    cpu = not launches_kernels(x) and kernel > 1  # a CPU (a GPU is traced as a CPU that launches kernels)
    padded = _channels_last_padded(x, pad, mode) if cpu else _padded(x, pad, mode)
    windows = _windows(padded, module, positions)  # (B, C, *positions, *kernel)
    b, c = windows.shape[:2]
    t = math.prod(windows.shape[2 : windows.dim() - (module.weight.dim() - 2)])
    if cpu:
        rows = windows.movedim(1, -1).reshape(b, t, kernel, g, c // g)  # runs of C/G values
        return rows.permute(0, 3, 1, 4, 2).reshape(b, g, t, (c // g) * kernel)
    return windows.reshape(b, g, c // g, t, kernel).permute(0, 1, 3, 2, 4).reshape(b, g, t, (c // g) * kernel)


# a convolution's per-sample gradients come from one grouped convolution (CPU) when each sample has
# at least this many output positions per input channel of a group, else from its patches: oneDNN's
# grouped weight gradient is fast for long per-group products and slow for short, wide ones. Measured
# (benchmarks/conv_routes.py, benchmarks/results/conv_routes; norm and clipped sum included): the
# rule picks the faster route at 11 of 14 ResNet layer shapes (grouped 1.3-9.8x faster from T >= C_in,
# 0.5-0.8x below it); the three misses cost at most 16%
GROUPED_MIN_POSITIONS = 1.0


def by_grouped_convolution(
    x: torch.Tensor, pad: list[int] | None, mode: str, grad_output: torch.Tensor, module
) -> torch.Tensor:
    """Each sample's weight gradient, (B, *weight.shape), as one convolution's weight gradient with
    the batch folded into its groups: no patches formed (zero padding the same on both sides of
    every dimension is the convolution's own: no padded copy either). Float32 at IEEE precision
    whatever the user set for oneDNN (bf16 or TF32 would round the operands); CPU only: measured
    there (benchmarks/results/conv_routes), not yet on a GPU."""
    b, nd, w = x.shape[0], x.dim() - 2, module.weight
    lo, hi = (pad[0::2], pad[1::2]) if pad else ([0] * nd, [0] * nd)
    if mode == "constant" and lo == hi and min(lo) >= 0:
        padding = lo[::-1]  # F.pad lists the last dimension first
    else:
        x, padding = _padded(x, pad, mode), [0] * nd
    x = x.float().reshape(1, b * x.shape[1], *x.shape[2:])
    g = grad_output.float().reshape(1, b * grad_output.shape[1], *grad_output.shape[2:])
    shape_only = x.new_empty(b * w.shape[0], *w.shape[1:])  # read for its shape: no input gradient is asked for
    stride, dilation = _tuple(module.stride, nd), _tuple(module.dilation, nd)
    with exact_matmuls():  # oneDNN's convolution, or aten's GEMM-based backend for small inputs
        grads = torch.ops.aten.convolution_backward(
            g, x, shape_only, None, stride, padding, dilation, False, [0] * nd, b * module.groups, [False, True, False]
        )[1]
    return grads.reshape(b, *w.shape)


def _conv_use(x: torch.Tensor, grad_output: torch.Tensor, module, pad, mode) -> LazyFactored:
    """The weight's use: the output gradient by group, the patches unfolded only if a path reads
    them, and on a CPU (float32 or half values) the per-sample gradients by grouped convolution.
    The input is padded only when a route reads it (not held padded through the step)."""
    g = grad_by_group(grad_output, module.groups)
    b, groups, t, n = _patches_shape(x, pad, module)
    if (b, groups, t) != tuple(g.shape[:3]) or n * g.shape[3] * groups != module.weight.numel():
        raise UnsupportedModuleError(
            f"{type(module).__name__}: the convolution dpzoo reconstructs from the module's attributes "
            f"(padding, stride, dilation, groups, kernel) has {t} output positions per sample, "
            f"the module's output {g.shape[2]}: the module does not compute what the Conv rule assumes."
        )
    grouped = (
        x.device.type == "cpu"
        and x.dtype != torch.float64
        and grad_output.dtype != torch.float64
        and t >= GROUPED_MIN_POSITIONS * (x.shape[1] // module.groups)
    )
    version = x._version  # read later: an in-place edit of the input in between must not go unseen

    def unedited(read):
        def checked():
            if x._version != version:
                raise UnsupportedModuleError(
                    f"The input of a {type(module).__name__} was modified in place after the step was assembled "
                    "(hooks.plan(), engine.plan() or the first norm): its per-sample gradients would be those of "
                    "the edited values. Edit a copy, or edit it before the forward pass."
                )
            return read()

        return checked

    per_sample = unedited(lambda: by_grouped_convolution(x, pad, mode, grad_output, module)) if grouped else None
    like = torch.empty(b, groups, t, n, dtype=x.dtype, device="meta")
    rows = unedited(lambda: _patches(x, pad, mode, module))
    return LazyFactored(g, rows, like, tuple(module.weight.shape), per_sample)


def grad_by_group(grad_output: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, out, *spatial) → (B, G, T, out/G)."""
    b, o = grad_output.shape[:2]
    return grad_output.reshape(b, groups, o // groups, -1).transpose(2, 3)


def _zeros_padding(module: _ConvNd, nd: int) -> list[int]:
    """F.pad amounts (last dim first) equal to what ``F.conv*d(..., padding=module.padding)`` does."""
    padding = module.padding
    kernel, dilation = tuple(module.weight.shape[2:]), _tuple(module.dilation, nd)
    if isinstance(padding, str):
        if padding == "valid":
            return [0, 0] * nd
        if padding != "same":
            raise UnsupportedModuleError(f"{type(module).__name__}: unknown padding {padding!r}")
        out = []
        for i in reversed(range(nd)):  # torch: left = total // 2, the odd remainder on the right
            total = dilation[i] * (kernel[i] - 1)
            out += [total // 2, total - total // 2]
        return out
    padding = _tuple(padding, nd)
    return [p for i in reversed(range(nd)) for p in (padding[i], padding[i])]


def _module_padding(module: _ConvNd, x: torch.Tensor) -> tuple[list[int], str]:
    """As ``_ConvNd._conv_forward``: F.pad(_reversed_padding_repeated_twice) for non-zero modes,
    the convolution's own ``padding`` for zeros."""
    nd = x.dim() - 2
    if module.padding_mode != "zeros":
        return list(module._reversed_padding_repeated_twice), module.padding_mode
    return _zeros_padding(module, nd), "constant"


def _conv_rule(module, activations, grad_output, params, pad_fn=_module_padding):
    out = {}
    if "weight" in params:
        x = activations[0]
        if not isinstance(x, torch.Tensor) or x.dim() != module.weight.dim():
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise UnsupportedModuleError(
                f"{type(module).__name__} got an input {shape} that is not a batch (N, C, ...) of the "
                f"convolution's {module.weight.dim() - 2}-d inputs: per-sample gradients need batch-first inputs."
            )
        pad, mode = pad_fn(module, x)
        out["weight"] = _conv_use(x, grad_output, module, pad, mode)
    if "bias" in params:  # summed over positions in float32 when the output gradient is half
        out["bias"] = Dense(upcast(grad_output).reshape(grad_output.shape[0], grad_output.shape[1], -1).sum(2))
    return out


# half_factors: the rule only pads, unfolds and reshapes (a layer under bf16 autocast hands over its
# input as autocast cast it, and padding commutes with that cast), so the products are those of .half
@register_rule(nn.Conv1d, nn.Conv2d, nn.Conv3d, activation_free={"bias"}, methods=("_conv_forward",), half_factors=True)
def conv_rule(module, activations, grad_output, params):
    return _conv_rule(module, activations, grad_output, params)


try:  # timm's Conv2dSame pads inside forward ('SAME' padding of TF-ported weights)
    from timm.layers.conv2d_same import Conv2dSame
    from timm.layers.padding import get_same_padding
except ImportError:  # pragma: no cover
    Conv2dSame = None


def _same_padding(module, x):
    ih, iw = x.shape[-2:]
    kh, kw = module.weight.shape[2:]
    ph = get_same_padding(ih, kh, module.stride[0], module.dilation[0])
    pw = get_same_padding(iw, kw, module.stride[1], module.dilation[1])
    return [pw // 2, pw - pw // 2, ph // 2, ph - ph // 2], "constant"


if Conv2dSame is not None:
    # conv2d_same(x, weight, bias, stride, (0, 0), dilation, groups): SAME padding, then none
    @register_rule(Conv2dSame, activation_free={"bias"})
    def conv2d_same_rule(module, activations, grad_output, params):
        return _conv_rule(module, activations, grad_output, params, pad_fn=_same_padding)


# --- weight standardisation (timm StdConv2d / ScaledStdConv2d, BiT ResNet-V2, NF-Nets) ----------
#
# forward: ŵ = γ ⊙ (w − mean(w)) / sqrt(var(w) + eps) per output channel (F.batch_norm over the
# fan-in; γ = gain · scale for the scaled variants, 1 otherwise), then a plain convolution with ŵ.
# The standardisation does not depend on the sample, so ∂L_i/∂w = Jᵀ ∂L_i/∂ŵ with the same J for
# every sample: the per-sample gradients with respect to ŵ (the Conv rule) are instantiated and
# pulled back through batch norm's backward, per sample (exact; B × the weight in memory).

try:
    from timm.layers.std_conv import ScaledStdConv2d, ScaledStdConv2dSame, StdConv2d, StdConv2dSame
except ImportError:  # pragma: no cover
    StdConv2d = None


def _std_padding(module, x):
    if getattr(module, "same_pad", False):  # pad_same(x, kernel, stride, dilation), then self.padding
        same, _ = _same_padding(module, x)
    else:
        same = [0, 0, 0, 0]
    static = _zeros_padding(module, 2)  # F.conv2d(..., self.padding): zeros, whatever padding_mode says
    return [a + b for a, b in zip(same, static)], "constant"


def _std_conv_rule(module, activations, grad_output, params):
    out = {}
    want = set(params) & {"weight", "gain"}
    if "bias" in params:
        out.update(_conv_rule(module, activations, grad_output, {"bias"}))
    if not want:
        return out
    o = module.out_channels
    w = module.weight.detach().reshape(o, -1)
    mean = w.mean(1, keepdim=True)
    invstd = torch.rsqrt(w.var(1, unbiased=False, keepdim=True) + module.eps)
    what = (w - mean) * invstd  # x̂ of batch norm, (O, n)
    gain = getattr(module, "gain", None)
    gamma = (gain.detach().reshape(o, 1) * module.scale) if gain is not None else None
    rep = _conv_rule(module, activations, grad_output, {"weight"}, pad_fn=_std_padding)["weight"]
    g = instantiate(rep).reshape(grad_output.shape[0], o, -1)  # ∂L_i/∂ŵ, (B, O, n)
    if "gain" in want:
        out["gain"] = Dense(((g * what).sum(2) * module.scale).reshape(-1, *module.gain.shape))
    if "weight" in want:
        dy = g * gamma if gamma is not None else g  # ∂L_i/∂x̂
        dw = invstd * (dy - dy.mean(2, keepdim=True) - what * (dy * what).mean(2, keepdim=True))
        out["weight"] = Dense(dw.reshape(-1, *module.weight.shape))
    return out


if StdConv2d is not None:
    register_rule(StdConv2d, StdConv2dSame, activation_free={"bias"})(_std_conv_rule)
    register_rule(ScaledStdConv2d, ScaledStdConv2dSame, params=("weight", "bias", "gain"), activation_free={"bias"})(
        _std_conv_rule
    )
