"""The floating-point guard on ghost norms: a norm the book-kept sum can trust.

A ghost norm ‖g‖² = Σ_{t,s}⟨L_t,L_s⟩⟨R_t,R_s⟩ is formed from Gram matrices, while the clipped sum
adds the gradient itself (one GEMM over the B·T rows). Where the two disagree in floating point
the clip factor does not bound what is added. Found by the audits:

* cancellation: positions whose gradients cancel (x₁ = x₂, δ₂ = −(1−ε)δ₁) make the Gram sum a
  small difference of terms ~U², U = Σ_t ‖L_t‖‖R_t‖ ≥ ‖g‖; in float32 it read 0 (326 R);
* underflow: activations of 1e-23 square to 0 in float32 while the products the sum forms
  (1e-23 · 1e17) do not: norm 0, the sample released unclipped (784 R);
* rounding: above those extremes, float32 rounding of Gram entries over wide layers let a crafted
  cancelling sample go out at 1.01 R (16,384 features) to 1.04 R (65,536).

:func:`guard` takes a parameter's computed squared norms, some uses on the ghost path, and
returns an upper bound on the exact ones, which the clip factor then uses:

1. U, Σ‖L_t‖ and Σ‖R_t‖ in float64 (no under- or overflow for float32 values);
2. the rigorous rounding bound of :mod:`.rounding` (γ_n · U², n the contraction lengths, plus what
   underflowed products can lose), added to the norm;
3. samples where that bound would inflate the norm by more than LOOSE/2 (0.8%), or below
   (RECHECK · U)², or not finite, recomputed in float64, where the same bound is 2²⁹ times
   smaller (products of float32 values neither round nor underflow in float64);
4. a floor at (GHOST_FLOOR · U)², so a gradient that cancels below it is clipped as if its norm
   were the floor (the clipped sum's own rounding, ≤ γ_T · U per sample, then stays a small
   fraction of R);
5. the result rounded up, never to nearest, into the norm's dtype.

Ordinary data never comes near the floor: ‖g‖ ≈ U/√T, 0.016·U at T = 4096. The bound costs the
ordinary sample less than LOOSE/2 of its norm (docs/DESIGN.md, "Floating point", has the measured
inflation and recompute rates).
"""

from __future__ import annotations

import torch

from . import reps as R
from . import rounding
from .half import launches_kernels
from .rounding import any_flag, round_up

__all__ = [
    "GHOST_FLOOR", "LOOSE", "RECHECK", "row_sums", "sq_norm64", "triangle_bound", "guard", "guards", "first_pass",
    "settle", "checked", "checked_and_bound", "checked_and_bounds", "round_up",
]  # fmt: skip

GHOST_FLOOR = 2.0**-8
RECHECK = 2.0**-6  # below RECHECK · U a float32 ghost norm is recomputed in float64
LOOSE = 2.0**-6  # a rounding bound above LOOSE · ‖g‖² (the norm inflated by > 0.8%): recompute in float64


def _norm64(t: torch.Tensor, rescale: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(‖t‖ over the last dim in float64, the rows near the limits of squaring, or None where none
    can be). The norm is never below the exact one by more than its own rounding: every row gets
    √(k·s) added, s the subnormal spacing, for squares that underflowed (half-precision rows are
    summed in float32); rows near the limits (or 0, inf, NaN) are scaled by their largest entry
    first, where ``rescale`` (one host read); without it their norms are left as computed, to be
    redone if any is marked. On a GPU (:func:`_launch_norm`) float32 and half rows are normed in
    float32 in one read and taken up by their rounding bound, and only huge rows are marked."""
    acc = torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype
    if acc == torch.float32 and launches_kernels(t):
        return _launch_norm(t, rescale)
    n = torch.linalg.vector_norm(t, dim=-1, dtype=acc)
    risky = ~((n > 2.0**-60) & (n < 2.0**60))
    spacing = torch.finfo(acc).smallest_normal * torch.finfo(acc).eps
    n = n.double() + (t.shape[-1] * spacing) ** 0.5
    if rescale and risky.any():
        rows = t[risky]
        top = rows.abs().amax(-1, keepdim=True)
        top = torch.where(top > 0, top, torch.ones_like(top))
        n[risky] = torch.linalg.vector_norm(rows / top, dim=-1, dtype=acc).double() * top.squeeze(-1).double()
    return n, risky


def _launch_norm(t: torch.Tensor, rescale: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`_norm64` on a GPU: ‖t‖ over the last dim (k entries) in float32, plus √(k·s) (squares
    that underflowed), (1 + γ_{k+8}) larger (the norm's rounding, as rounding.dense_sq_norm): never
    below the exact norm, in four operators. Nothing is marked: a row whose squares overflowed is
    inf, which makes U and the ghost norm's bound inf, and the guard recomputes that sample (with
    ``rescale``, as on a CPU, such rows are rescaled by their largest entry). A tiny or zero row
    (the last position of a causal LM, padding: in every layer) is loose by √(k·s) ~ 1e-21 and costs
    no host read. CUDA reduces half rows into float32 inside the kernel; until 2026-11-28 they were
    normed in float64, which copies the input to float64 first (about 5 ms of GPT-2 small's bf16 DP
    step on an H200, profiled)."""
    k = t.shape[-1]
    up = 1 + rounding.gamma(k + 8, rounding.unit_roundoff(torch.float32))
    allowance = (k * torch.finfo(torch.float32).smallest_normal * torch.finfo(torch.float32).eps) ** 0.5
    n = torch.linalg.vector_norm(t, dim=-1, dtype=torch.float32)
    out = n.double().add_(allowance).mul_(up)
    if not rescale:
        return out, None
    risky = ~(n < 2.0**60)
    if risky.any():
        rows = t[risky]
        top = rows.abs().amax(-1, keepdim=True).float()
        top = torch.where((top > 0) & (top < float("inf")), top, torch.ones_like(top))
        out[risky] = torch.linalg.vector_norm(rows.float() / top, dim=-1).double() * up * top.squeeze(-1).double()
    return out, risky


def row_sums(rep: "R.Rep", rescale: bool = True) -> tuple:
    """(U, A, B, risky) per sample in float64: U = Σ_t ‖L_t‖‖R_t‖ ≥ ‖g‖, A = Σ_t ‖L_t‖,
    B = Σ_t ‖R_t‖ (one-hot rows have norm 1; a dense gradient is its own single row on both sides);
    risky: None, or a device bool, whether a row norm was near the limits of squaring (``rescale``:
    rescaled, one host read; else left as computed, so the sums are not to be used where True)."""
    if isinstance(rep, R.Dense):  # row norms over the last dimension, then in float64
        g = rep.grad
        n, risky = _norm64(g.reshape(g.shape[0], -1, g.shape[-1]) if g.dim() > 1 else g.unsqueeze(1), rescale)
        n = n.square().sum(1).sqrt()
        return n, n, n, _any(risky)
    right, risky = _norm64(rep.right, rescale)
    if isinstance(rep, R.OneHot):
        s = right.sum(1)
        return s, torch.full_like(s, float(rep.index.shape[1])), s, _any(risky)
    left, risky_left = _norm64(rep.left, rescale)
    sums = (left * right).flatten(1).sum(1), left.flatten(1).sum(1), right.flatten(1).sum(1)
    return (*sums, _any(risky, risky_left))


def _any(*masks: torch.Tensor | None) -> torch.Tensor | None:
    """Whether any entry of any mask is True (a device bool); None if every mask is None."""
    out = None
    for m in masks:
        if m is not None:
            out = m.any() if out is None else out | m.any()
    return out


def triangle_bound(rep: "R.Rep") -> torch.Tensor:
    """U_i = Σ_t ‖L_t‖‖R_t‖ ≥ ‖g_i‖ in float64 (one-hot rows have norm 1), free of cancellation."""
    return row_sums(rep)[0]


def _rows64(rep: "R.Rep", rows: torch.Tensor) -> "R.Rep":
    """The samples ``rows`` of ``rep``, in float64."""
    if isinstance(rep, R.Dense):
        return R.Dense(rep.grad[rows].double())
    if isinstance(rep, R.Factored):
        return R.Factored(rep.left[rows].double(), rep.right[rows].double(), rep.shape)
    return R.OneHot(rep.index[rows], rep.right[rows].double(), rep.num_rows)


def sq_norm64(reps: list, rows: torch.Tensor) -> torch.Tensor:
    rs = [_rows64(r, rows) for r in reps]
    total = sum(R.sq_norm(r, ghost=True) for r in rs)
    for i in range(len(rs)):
        for j in range(i + 1, len(rs)):
            total = total + 2 * R.inner(rs[i], rs[j], ghost=True)
    return total.clamp_min(0)


def guard(reps: list, total: torch.Tensor) -> torch.Tensor:
    """An upper bound on the exact per-sample squared norms of a parameter whose ``reps`` are (in
    part) on the ghost path, ``total`` being their computed value: the rounding bound of
    :mod:`.rounding` added, samples where that bound is loose (or ``total`` not finite) recomputed
    in float64, floored at (GHOST_FLOOR · U)²; in ``total``'s dtype, rounded up."""
    return guards([(reps, total)])[0]


def guards(items: list[tuple[list, torch.Tensor]]) -> list[torch.Tensor]:
    """:func:`guard` of each (reps, total), one host read for all where no sample needs its float64
    norm and no row its rescaled norm (on a GPU each read waits for the queue); those that do are
    guarded again one by one, as they would be alone. On a CPU, one by one."""
    if not any(launches_kernels(total) for _, total in items):  # a CPU's host reads cost nothing
        return [checked(reps, total) for reps, total in items]
    checks = [lambda r=reps, t=total: checked(r, t) for reps, total in items]
    return settle(checks, [first_pass(reps, total)[:2] for reps, total in items])


def settle(checks: list, firsts: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """The guarded norms from their first passes (``firsts``: (result, flag), e.g. :func:`first_pass`'s),
    with one host read: where a flag is set, that item's ``check`` (a function of no argument, e.g.
    :func:`checked` of its reps, made again where they are not held) gives its norm with its reads."""
    fired = any_flag([flag for _, flag in firsts])
    return [check() if fired and bool(flag) else result for check, (result, flag) in zip(checks, firsts)]


def first_pass(reps: list, total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the guarded norm where the flag, a device bool, is False, the flag, U = Σ_t ‖L_t‖‖R_t‖ over
    the uses; no host read): the checked guard's operators but the rescaling of risky rows and the
    float64 recomputation, which the flag marks (:func:`settle` then guards the item again with them)."""
    sums = [row_sums(r, rescale=False) for r in reps]
    result, redo = _bounded(reps, total, [s[:3] for s in sums])
    flag = _any(redo, *(s[3] for s in sums))
    assert flag is not None
    return result[0], flag, result[4]


def _bounded(reps: list, total: torch.Tensor, sums: list) -> tuple[tuple, torch.Tensor]:
    """((the guarded norm if no sample is redone, out, err, floor, U), the samples to redo in float64:
    below RECHECK · U, a bound above LOOSE of the norm, or not finite; any comparison with a NaN)."""
    bound = sums[0][0]
    for s in sums[1:]:
        bound = bound + s[0]
    err = rounding.error_bound(reps, sums, total.dtype)
    out = total.double()
    result, floor, redo = _guarded(out, err, bound, total.dtype)
    return (result, out, err, floor, bound), redo


def _guarded(out: torch.Tensor, err: torch.Tensor, bound: torch.Tensor, dtype: torch.dtype) -> tuple:
    """(the guarded norm in ``dtype``, the floor, the samples to redo) from the computed squared norm
    in float64 (``out``), its rounding bound (``err``) and U (``bound``), element by element."""
    floor = (GHOST_FLOOR * bound).square()
    if dtype == torch.float64:
        redo = out < floor
    else:  # (RECHECK · U)² = (RECHECK / GHOST_FLOOR)² · floor, a power of two
        redo = ~((out >= floor * (RECHECK / GHOST_FLOOR) ** 2) & (out * LOOSE >= err) & (out < float("inf")))
    return round_up(torch.maximum(out + err, floor), dtype), floor, redo


def checked(reps: list, total: torch.Tensor) -> torch.Tensor:
    """The guard with its host reads: risky rows rescaled, loose samples recomputed in float64."""
    return checked_and_bound(reps, total)[0]


def checked_and_bound(reps: list, total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(:func:`checked`, U = Σ_t ‖L_t‖‖R_t‖ over the uses, which it formed)."""
    sums = [row_sums(r)[:3] for r in reps]
    (result, out, err, floor, u), redo = _bounded(reps, total, sums)
    if not redo.any():
        return result, u
    rows = redo.nonzero().squeeze(1)
    out = out.index_copy(0, rows, sq_norm64(reps, rows))
    err64 = rounding.error_bound(reps, [tuple(x[rows] for x in s) for s in sums], torch.float64)
    err = err.index_copy(0, rows, err64)
    return round_up(torch.maximum(out + err, floor), total.dtype), u


def checked_and_bounds(items: list[tuple[list, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`checked_and_bound` of each (reps, total), where operators are not launched (a CPU): the
    bounds of single-use items of one dtype, batch and device as one stack, one row per item (a
    ResNet's guards were ~45 small operators a layer, most of their time), by the operations of
    :func:`_bounded` and :func:`.rounding.error_bound` element by element, so the same values; an
    item with a sample to redo or a row near the limits of squaring is guarded again alone."""
    out: list = [None] * len(items)
    groups: dict[tuple, list[int]] = {}
    for i, (reps, total) in enumerate(items):
        if len(reps) == 1 and total.dtype != torch.float64 and not launches_kernels(total):
            groups.setdefault((total.dtype, total.shape[0], total.device), []).append(i)
        else:
            out[i] = checked_and_bound(*items[i])
    for (dtype, _, device), idx in groups.items():
        if len(idx) == 1:
            out[idx[0]] = checked_and_bound(*items[idx[0]])
            continue
        sums = [row_sums(items[i][0][0], rescale=False) for i in idx]  # risky rows marked, not rescaled
        u, a, b = (torch.stack([s[k] for s in sums]) for k in range(3))
        # bound_constants of a single use: (c of the one pair of uses, scale, grid), each a column
        consts = [rounding.bound_constants(items[i][0], dtype) for i in idx]
        c, scale, grid = (
            torch.tensor(col, dtype=torch.float64, device=device).view(-1, 1)
            for col in ([k[0][0][0] for k in consts], [k[1] for k in consts], [k[2] for k in consts])
        )
        err = rounding.with_underflow(u * u * c, a + b, u, scale, grid)
        result, _, redo = _guarded(torch.stack([items[i][1] for i in idx]).double(), err, u, dtype)
        flags = redo.any(1)
        if any(s[3] is not None for s in sums):  # rows near the limits: those items alone, rescaled
            flags = flags | torch.stack([s[3] if s[3] is not None else flags[k] for k, s in enumerate(sums)])
        for k, (i, again) in enumerate(zip(idx, flags.tolist())):
            out[i] = checked_and_bound(*items[i]) if again else (result[k], u[k])
    return out
