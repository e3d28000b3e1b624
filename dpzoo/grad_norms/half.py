"""Exact products of half-precision factors, in float32: the per-sample norms and clipped sums of
layers that ran in bfloat16 or float16 (autocast, or a half-precision model).

A product of two bfloat16 values (8 significant bits each) or two float16 values (11) is exact in
float32 (24 bits), so a matrix product of half operands accumulated in float32 is the float32
product of the upcast values, up to the order of the additions (which :mod:`.rounding`'s bound
does not assume). On CUDA it runs on tensor cores with a float32 output (``out_dtype``), reading
the half operands as they are: no upcast copy, and 3-5x the speed of float32 arithmetic on an
H100 (measured, benchmarks/results/gpu_h100_1126/gemm_probe.json). Elsewhere the operands are
upcast and multiplied in float32 at "highest" precision (never TF32, which would round float32
values).

The clipped sum Σ_i c_i L_iᵀ R_i needs c_i on one factor. c_i is first rounded toward zero to a
bfloat16 value, once for every use of the parameter (:func:`shared_scale`: uses that cancel must
share one factor, or the difference of their factors is released; a sample adds less than 2⁻⁷
of its share less than its clip allows, never more). Each c̃_i·L_t then has at most 16
significant bits: exactly hi + lo with hi and lo bfloat16 (the residual of rounding to 8 bits
fits in 8), and the sum is two exact half products. Not below 2⁻¹¹⁸, where lo falls among
bfloat16's subnormals (an independent review released 1.98 R there with crafted activations near
float32's maximum), nor above bfloat16's range: such a sum is computed in float64
(:func:`kept_bits` says when).
"""

from __future__ import annotations

import os
import threading
from contextlib import ContextDecorator

import torch

__all__ = [
    "HALF", "upcast", "exact_matmuls", "product", "split_bfloat16", "round_toward_zero", "shared_scale", "kept_bits",
    "scaled_product", "flagged_scaled_product", "lost_bits", "has_bfloat16_factors", "TENSOR_CORE_DEVICES", "on_tensor_cores", "LAUNCH_DEVICES", "launches_kernels",
]  # fmt: skip

HALF = (torch.float16, torch.bfloat16)
# device types whose half products run as one float32-output product (``out_dtype``); the cost
# report (benchmarks/cost_trace.py) adds "cpu" to trace on a CPU the operators CUDA runs
TENSOR_CORE_DEVICES = {"cuda"}
# device types whose operators are kernels launched on a queue (the cost report adds "cpu" too)
LAUNCH_DEVICES = {"cuda"}


def upcast(t: torch.Tensor) -> torch.Tensor:
    """Half-precision values in float32 (‖g‖ > 256 overflows float16); other dtypes as they are."""
    return t.float() if t.dtype in HALF else t


_EXACT: dict = {"depth": 0, "before": None}  # process-wide, as the settings are: the last thread out restores
_EXACT_LOCK = threading.Lock()
_BACKENDS = (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul, torch.backends.mkldnn.conv)  # type: ignore[attr-defined]


class exact_matmuls(ContextDecorator):  # noqa: N801  (named as the function it was: a context and a decorator)
    """float32 matmuls at IEEE precision whatever the user set: TF32 rounds float32 operands to 10
    bits (bfloat16 on a CPU at "medium"), and :mod:`.rounding`'s bound (and a clipped sum's
    exactness) assume it does not. Set per backend (CUDA's and oneDNN's ``fp32_precision``), the
    API torch asks for since 2.9: the legacy ``torch.set_float32_matmul_precision`` raised here for
    a user who had set ``torch.backends.fp32_precision`` (found by an independent review). oneDNN's
    convolutions too (the per-sample route of :mod:`.rules.conv`). Re-entrant and counted across
    threads (the settings are the process's): the user's settings come back when the last context
    of any thread exits, so one thread leaving cannot lower another's precision mid-step. A class,
    not a generator: a GPU step enters it ~300 times, and each generator entry cost five Python
    calls of host time (benchmarks/cost_trace.py counts them)."""

    def __enter__(self) -> None:
        with _EXACT_LOCK:
            if _EXACT["depth"] == 0:
                _EXACT["before"] = [b.fp32_precision for b in _BACKENDS]
            for b in _BACKENDS:  # nested entries too: another thread (or an interrupted exit) may have changed them
                if b.fp32_precision != "ieee":
                    b.fp32_precision = "ieee"
            _EXACT["depth"] += 1

    def __exit__(self, *exc) -> None:
        with _EXACT_LOCK:
            _EXACT["depth"] -= 1
            if _EXACT["depth"] == 0:
                for b, value in zip(_BACKENDS, _EXACT["before"]):
                    b.fp32_precision = value


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) runs none of the parent's threads: their contexts are
    gone, so their count and a lock one of them may have held are reset, the user's settings back."""
    global _EXACT_LOCK
    if _EXACT["depth"]:
        for b, value in zip(_BACKENDS, _EXACT["before"]):
            b.fp32_precision = value
    _EXACT["depth"], _EXACT_LOCK = 0, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def on_tensor_cores(a: torch.Tensor, b: torch.Tensor) -> bool:
    devices = TENSOR_CORE_DEVICES
    return a.dtype == b.dtype and a.dtype in HALF and a.device.type in devices and b.device.type in devices


def launches_kernels(t: torch.Tensor) -> bool:
    """Whether ``t``'s operators are kernels queued on an accelerator (:data:`LAUNCH_DEVICES`):
    there each operator costs a launch, so one larger operator (with a copy) beats many small
    ones, where a CPU runs the small ones faster."""
    return t.device.type in LAUNCH_DEVICES


def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for (…, n, k) × (…, k, m) with equal leading dimensions: half operands multiplied
    exactly into a float32 result, anything else at its own (upcast) precision."""
    if not on_tensor_cores(a, b):
        with exact_matmuls():
            return torch.matmul(upcast(a), upcast(b))
    lead = a.shape[:-2]
    out = torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]), out_dtype=torch.float32)
    return out.reshape(*lead, *out.shape[-2:])


def split_bfloat16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) in bfloat16 with hi + lo = x, for float32 ``x`` of at most 16 significant bits."""
    hi = x.to(torch.bfloat16)
    return hi, (x - hi.float()).to(torch.bfloat16)


def round_toward_zero(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scale`` in ``dtype``, never larger in magnitude: to nearest it could grow by 2⁻⁹ (bfloat16)."""
    if scale.dtype == dtype:
        return scale
    if dtype in _WIDER.get(scale.dtype, ()):  # every value of scale's dtype is one of dtype's
        return scale.to(dtype)
    low = scale.to(dtype)
    return torch.where(low.to(scale.dtype).abs() > scale.abs(), torch.nextafter(low, torch.zeros_like(low)), low)


def has_bfloat16_factors(reps) -> bool:
    """Whether any of ``reps`` is a factored use with bfloat16 factors (its clipped sum scales them)."""
    for r in reps:  # a loop, not any(...): a generator is a frame per use, every step
        if getattr(r, "left", None) is not None and r.left.dtype == r.right.dtype == torch.bfloat16:
            return True
    return False


_WIDER = {
    torch.bfloat16: (torch.float32, torch.float64),
    torch.float16: (torch.float32, torch.float64),
    torch.float32: (torch.float64,),
}


def shared_scale(reps, scale: torch.Tensor) -> torch.Tensor:
    """``scale`` rounded toward zero to bfloat16 (a bfloat16 tensor: rounding it again is free) if
    any of ``reps`` is a bfloat16 factored use, so that every use of the parameter is scaled by the
    same c̃_i."""
    return round_toward_zero(scale, torch.bfloat16) if has_bfloat16_factors(reps) else scale


SPLIT_TINY = 2.0**-118  # below it, lo of a 16-bit value can need bits under bfloat16's subnormal spacing


def lost_bits(narrow: torch.Tensor, scaled: torch.Tensor, tiny: float) -> torch.Tensor:
    """Whether ``scaled`` (``narrow`` times the per-sample scale) lost a bit, a device bool (no host
    read where operators are launched): not finite, or below ``tiny`` where ``narrow`` is not 0
    (below it products lose bits or vanish, and the other factor can multiply what was lost far
    beyond the clip). On a CPU every |value| in [tiny, max] says no at once, from two reductions and
    one host read: operators that write bool tensors cost 5-30x an abs or a min there (2 cores,
    2026-11-28: ``lost_bits`` was ~2 ms of ResNet-18-GN@32's step)."""
    size = scaled.abs()
    if not launches_kernels(scaled) and scaled.numel():
        within = (size.amin() >= tiny) & (size.amax() <= torch.finfo(scaled.dtype).max)  # False for a NaN
        if bool(within):
            return ~within
    return (((size < tiny) & (narrow != 0)) | ~torch.isfinite(scaled)).any()


def kept_bits(narrow: torch.Tensor, scaled: torch.Tensor, tiny: float) -> bool:
    """Not :func:`lost_bits`: one host synchronisation."""
    return not bool(lost_bits(narrow, scaled, tiny))


def scaled_product(left: torch.Tensor, right: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """Σ_i scale_i · left_iᵀ right_i, (r, c) in float32, for bfloat16 factors ``left``: (B, T, r)
    and ``right``: (B, T, c), the scale already bfloat16 values (:func:`shared_scale`). The scale
    goes on the narrower factor, split exactly into two. None where the split is not exact."""
    total, lost = flagged_scaled_product(left, right, scale)
    return None if bool(lost) else total


def flagged_scaled_product(
    left: torch.Tensor, right: torch.Tensor, scale: torch.Tensor, blocks: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """(:func:`scaled_product`'s sum, whether the split lost a bit: a device bool, no host read;
    where True the sum is not to be used). ``blocks``: the samples are that many equal blocks
    (uses of one shape stacked along the batch), each summed on its own: (blocks, r, c)."""
    t, r = left.shape[1:]
    c = right.shape[-1]
    weights = round_toward_zero(scale, torch.bfloat16).float().view(-1, 1, 1)
    narrow, other = (left, right) if r <= c else (right, left)
    hi, lo = split_bfloat16(narrow.float() * weights)  # exact: 8 × 8 significant bits
    lost = lost_bits(narrow, hi.float() + lo.float(), SPLIT_TINY)  # not finite if hi overflowed
    lead = (blocks,) if blocks > 1 else ()  # each block's B·T rows one contraction, as alone
    other = other.reshape(*lead, -1, other.shape[-1])
    total = product(hi.reshape(*lead, -1, hi.shape[-1]).transpose(-1, -2), other)
    total = total.add_(product(lo.reshape(*lead, -1, lo.shape[-1]).transpose(-1, -2), other))
    return (total if r <= c else total.transpose(-1, -2)), lost
