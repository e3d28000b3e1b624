"""Norms of single factored uses formed one at a time and freed, on a GPU: the instantiation path
without holding every per-sample gradient until the clip factors are known.

A use g_i = Σ_t L_{i,t}ᵀ R_{i,t} (one group) on the instantiation path was formed, normed and held,
its clipped sum a product over the held tensor. On an H200 (bf16 GPT-2 small T128, BK-MixOpt,
profiled 2026-11-28, benchmarks/results/gpu_h200_1128/head_95928c5) the held gradients made the
step's peak 3.05x non-private, and reading them back for the sums took 4.9 ms. Here each use is
formed, normed and dropped before the next; its clipped sum is then taken from its factors as on
the ghost path (one product, stacked with the uses of its shape: :mod:`.param_grad`).

The norm must bound what that sum adds, the exact g. The formed g̃ (a float32 product, any order of
additions) differs from it entrywise by at most γ_{T+2}·(|L|ᵀ|R|) + T·s (T positions, s the
subnormal spacing: products that underflow), so ‖g‖ ≤ ‖g̃‖ + e with e = γ_{T+2}·U + T·s·√n,
U = Σ_t ‖L_t‖‖R_t‖ ≥ ‖|L|ᵀ|R|‖ (:func:`.float_guard.row_sums`, taken up by its own rounding) and n
the gradient's entries. The squared norm used is (√N + e)², N ≥ ‖g̃‖² the dense bound
(:func:`.rounding.sq_bounds`), floored at (GHOST_FLOOR · U)² as a ghost norm is (the factored
sum's own rounding, ≤ γ_T · U a sample, stays a small share of R). Samples where e would raise the
norm by more than LOOSE of it, below RECHECK · U, or not finite are recomputed from their factors
in float64, where products of float32 values are exact and e is 2²⁹ times smaller. One host read
serves every use of a step (:func:`.float_guard.settle`).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from . import reps as R
from .float_guard import GHOST_FLOOR, LOOSE, RECHECK, row_sums
from .half import launches_kernels, on_tensor_cores, upcast
from .rounding import dense_chunk, gamma, round_up, runs_sq, sq_bounds, unit_roundoff

__all__ = ["formable", "first_passes", "checked", "product_error", "by_batch"]

_FORMED_IN_FLOAT32 = (torch.float32, torch.float16, torch.bfloat16)  # factor dtypes whose products form in float32


def formable(rep) -> bool:
    """Whether ``rep`` is normed by forming it and freeing it: a plain factored use of one group
    (not a convolution's lazy one) with float32 or half factors, on a device that launches kernels."""
    return (
        type(rep) is R.Factored
        and rep.left.shape[1] == 1
        and launches_kernels(rep.left)
        and rep.left.dtype in _FORMED_IN_FLOAT32
        and rep.right.dtype in _FORMED_IN_FLOAT32
    )


def by_batch(grads: list) -> list[list]:
    """``grads`` (:class:`~.param_grad.ParamGrad` of single factored uses) in groups of one batch size and device."""
    groups: dict[tuple, list] = {}
    for g in grads:
        groups.setdefault((g.batch_size, g.reps[0].left.device), []).append(g)
    return list(groups.values())


def _slope(rep: R.Factored, dtype: torch.dtype) -> tuple[float, float]:
    """(a, c): e = a·U + c where U > 0, the bound of :func:`product_error`."""
    _, _, t, p = rep.left.shape
    k = max(p, rep.right.shape[3])
    # tensor cores add blocks of products aligned to the largest and truncated (Fasi et al. 2021,
    # "Numerical behavior of NVIDIA tensor cores"): up to 5 ulp of the running sum a block of 4, so
    # a unit roundoff four times round-to-nearest's is taken
    ur = unit_roundoff(dtype) * (4 if on_tensor_cores(rep.left, rep.right) else 1)
    slope = gamma(t + 2, ur) * (1 + gamma(k + t + 8, ur))  # U's own rounding: row norms, T additions
    spacing = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    return slope, t * spacing * math.sqrt(math.prod(rep.shape))


def product_error(rep: R.Factored, u: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e ≥ ‖g − g̃‖ per sample for a product formed in ``dtype`` (see the module docstring); 0 where
    U = 0 (no position has both factors nonzero: every product is an exact 0)."""
    slope, floor = _slope(rep, dtype)
    return (u * slope).add_((u > 0) * floor)


def first_passes(
    reps: list[R.Factored],
) -> list[tuple[torch.Tensor, torch.Tensor, Callable[[], torch.Tensor], torch.Tensor]]:
    """For each of ``reps`` (one batch size and device, each :func:`formable`): (the bounded squared
    norms where the flag is False, the flag: a device bool, the check that gives the norms with
    their float64 recomputations where it is True, U per sample); no host read. Each formed gradient is read once
    and freed before the next is formed; the bound's arithmetic runs once for all of them."""
    if not reps:
        return []
    sqs, us = [], []
    for rep in reps:
        grad = R.instantiate(rep)
        sqs.append(runs_sq(upcast(grad)))
        del grad  # freed before the next use is formed
        us.append(row_sums(rep, rescale=False)[0])
    bound, redo = sq_bounds(sqs, [math.prod(rep.shape) for rep in reps], dense_chunk(reps[0].left))
    parts = [_slope(rep, torch.float32) for rep in reps]
    u = torch.stack(us)
    err = torch.stack(torch._foreach_add(torch._foreach_mul(us, [a for a, _ in parts]), [c for _, c in parts]))
    root = bound.sqrt()
    total = (root + err.mul_(u > 0)).square()
    floor = (GHOST_FLOOR * u).square()
    redo |= ~((root >= RECHECK * u) & (total <= bound * (1 + LOOSE)) & (total < float("inf")))
    results = round_up(torch.maximum(total, floor), torch.float32)
    flags = redo.any(1)
    return [
        (result, flag, lambda r=rep, x=result, m=marks: checked(r, x, m), ui)
        for rep, result, flag, marks, ui in zip(reps, results.unbind(0), flags.unbind(0), redo.unbind(0), u.unbind(0))
    ]


def checked(rep: R.Factored, result: torch.Tensor, redo: torch.Tensor) -> torch.Tensor:
    """``result`` with the samples ``redo`` marks recomputed from their factors in float64: the
    formed gradient's float64 sum of squares, the product's error bound and the floor, rounded up."""
    rows = redo.nonzero().squeeze(1)
    if not len(rows):
        return result
    left, right = rep.left[rows].double(), rep.right[rows].double()
    wide = R.Factored(left, right, rep.shape)
    flat = R.instantiate(wide).flatten(1)
    sq = torch.linalg.vector_norm(flat, dim=1).square() * (1 + gamma(flat.shape[1] + 3, unit_roundoff(torch.float64)))
    u = (torch.linalg.vector_norm(left, dim=-1) * torch.linalg.vector_norm(right, dim=-1)).flatten(1).sum(1)
    total = (sq.sqrt() + product_error(wide, u, torch.float64)).square()
    floor = (GHOST_FLOOR * u).square()
    return result.index_copy(0, rows, round_up(torch.maximum(total, floor), torch.float32))
