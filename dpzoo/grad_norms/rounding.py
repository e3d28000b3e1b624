"""Rigorous bounds on the floating-point error of a ghost-path squared norm.

A ghost norm is a sum of products of Gram entries, ‖g‖² = Σ_{t,s}⟨L_t,L_s⟩⟨R_t,R_s⟩, and a
sample whose positions cancel makes it a small difference of terms as large as U² (U = Σ_t
‖L_t‖‖R_t‖ ≥ ‖g‖). Its float32 rounding error is then a large fraction of ‖g‖² itself, and a
crafted sample is clipped by a norm that is too small (1.01 R at 16,384 features, 1.04 R at 65,536,
tests/test_float_rounding.py). The bound here makes the clip exact in the arithmetic used.

Every quantity the norm is made of is a sum (or a dot product) computed by the library in some
order we do not know; for any order, a sum of n terms carries an error of at most
γ_n · Σ|terms|, γ_n = n·u/(1 − n·u) (Higham, *Accuracy and Stability of Numerical Algorithms*,
2nd ed., §3.1 and Lemma 3.1). Each term of every Gram product and cross term is bounded by a
product of factor-row norms, so the whole squared norm, every use and cross term of a parameter
together, is off by at most Σ_{u,v} γ_{n(u,v)} · U_u U_v over pairs of uses, n(u,v) the additions
that term goes through (features, the positions of both, groups; :func:`pair_length`). The
sums are written as nested reductions, one dimension at a time (:func:`sum_per_sample`), so n grows
with T and not with T², and Gram entries are accumulated in chunks of GRAM_CHUNK features, so n
grows with 256 + k/256 and not with k (measured: 5× fewer samples recomputed in float64 on a
width-768 GPT-2, benchmarks/results/float_guard). Products that fall below the smallest normal number lose at most the
subnormal spacing each, however many features they are summed over; :func:`error_bound` adds that
too, so a sample whose values would underflow gets a bound larger than its norm and is recomputed
in float64.

A dense squared norm (a per-sample gradient held whole: biases, instantiated layers) is summed in
float32 as norms of short runs and bounded the same way (:func:`dense_sq_norm`): any order of a run's
k squares is off by γ_k relatively, and a square or partial sum flushed below the smallest normal number
loses less than that number each; a sample whose bound is loose, or whose norm overflowed, is
summed again in float64 (a float64 sum of float32 squares cannot under- or overflow).
"""

from __future__ import annotations

import math

import torch

from .half import launches_kernels

__all__ = [
    "GRAM_CHUNK", "mechanism_dtype", "unit_roundoff", "gamma", "sum_per_sample", "pair_length", "error_bound", "round_up",
    "bound_constants", "with_underflow", "dense_sq_norm", "dense_sq_norms", "runs_sq", "sq_bounds", "dense_chunk", "DENSE_LOOSE", "any_flag", "read_flags",
]  # fmt: skip

GRAM_CHUNK = 256  # Gram matrices are summed over chunks of this many features (reps._gram)


def mechanism_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the DP mechanism forms a parameter's clipped sum and noise in: float32 for a
    half-precision parameter (in bfloat16 a sample's rounded contribution could read (1 + 2⁻⁹) R),
    else the parameter's own. The noisy sum is cast to the parameter's dtype afterwards, which is
    post-processing of the float32 mechanism."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def unit_roundoff(dtype: torch.dtype) -> float:
    """u: half the spacing of floats at 1 (round to nearest)."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, u: float) -> float:
    """γ_n = n·u / (1 − n·u): the relative error of any n-term sum or dot product."""
    if n * u >= 0.5:
        return float("inf")
    return n * u / (1 - n * u)


def sum_per_sample(x: torch.Tensor) -> torch.Tensor:
    """Σ over every dimension but the first, one dimension at a time: the rounding error then
    grows with the sum of the dimensions, not their product (T + T, not T², for a Gram product)."""
    while x.dim() > 1:
        x = x.sum(-1)
    return x


def _lengths(rep) -> tuple[str, int, int, int, int]:
    """(kind, T, features of the left factor, features of the right factor, groups)."""
    if hasattr(rep, "grad"):
        return "dense", 0, 0, 0, 0
    if hasattr(rep, "left"):
        _, g, t, r = rep.left.shape
        return "factored", t, r, rep.right.shape[3], g
    return "onehot", rep.index.shape[1], rep.num_rows, rep.right.shape[-1], 1


def _chunked(k: int) -> int:
    """Additions in a Gram entry over k features summed in chunks of GRAM_CHUNK."""
    return min(k, GRAM_CHUNK) + -(-k // GRAM_CHUNK)


def pair_length(u, v) -> int:
    """The longest chain of additions in ⟨g_u, g_v⟩ as :mod:`.reps` computes it (a Gram entry over
    the features, then one nested reduction per dimension), plus the products' own roundings."""
    rank = {"dense": 0, "factored": 1, "onehot": 2}
    (ku, tu, ru, cu, gu), (kv, tv, rv, cv, gv) = sorted((_lengths(u), _lengths(v)), key=lambda x: rank[x[0]])
    if ku == "dense" and kv == "dense":
        return sum(u.grad.shape[1:]) + 2
    if ku == "dense":
        if kv == "factored":
            return rv + cv + tv + gv + 2
        return tv + cv + 2
    if ku == "factored" and kv == "factored":
        return _chunked(ru) + _chunked(cu) + tu + tv + gu + 2
    if ku == "onehot" and kv == "onehot":
        return _chunked(cu) + tu + tv + 2
    if gu == 1 and ru == rv:  # a factored use and a lookup: the Phantom Clipping cross term
        return _chunked(cv) + tu + tv + 2
    return tu + tv + rv + cv + 2  # both instantiated, summed over (rows, features)


def error_bound(reps: list, row_sums: list, dtype: torch.dtype) -> torch.Tensor:
    """E ≥ |computed − exact| per sample for a parameter's squared norm over ``reps`` (every use
    and cross term) in ``dtype``'s arithmetic: Σ_{u,v} γ_{n(u,v)} · U_u U_v, plus what products that
    underflow can lose. ``row_sums``: per use, (U, A, B) = Σ_t ‖L_t‖‖R_t‖, Σ_t ‖L_t‖, Σ_t ‖R_t‖ in
    float64, each U computed with its own rounding (so taken (1 + γ) larger)."""
    cs, scale, grid = bound_constants(reps, dtype)
    total = None
    for i in range(len(reps)):
        for j in range(len(reps)):
            total = (
                row_sums[i][0] * row_sums[j][0] * cs[i][j]
                if total is None
                else total.addcmul_(row_sums[i][0], row_sums[j][0], value=cs[i][j])
            )
    ab = row_sums[0][1] + row_sums[0][2]
    for s in row_sums[1:]:
        ab = ab + s[1] + s[2]
    bound = row_sums[0][0] if len(row_sums) == 1 else sum(s[0] for s in row_sums)
    return with_underflow(total, ab, bound, scale, grid)


def with_underflow(cross: torch.Tensor, ab: torch.Tensor, bound: torch.Tensor, scale, grid) -> torch.Tensor:
    """:func:`error_bound` from the bound on its rounding, ``cross`` (written into): plus what
    products that underflow can lose, (A + B + 1)² · scale + grid, where U = ``bound`` > 0
    (``scale``, ``grid``: :func:`bound_constants`', numbers or a column of them, one per row)."""
    # U = 0: no position has both factors nonzero, so every product of Gram entries is an exact 0
    return cross.addcmul_((ab + 1).square().mul_(scale).add_(grid), bound > 0)


def bound_constants(reps: list, dtype: torch.dtype) -> tuple:
    """:func:`error_bound`'s numbers, the same for every sample: (c[u][v], the factor of (A + B + 1)²
    and the constant of its underflow term). c = γ(1 + γ)², γ over the additions of the pair's term;
    a product that underflows loses up to the subnormal spacing s: a Gram entry over r features up
    to r·s, times the other factor's Gram (≤ B² summed); a dense use's squares and products lose up
    to its numel·s; and each product of two Gram entries one more s."""
    u = unit_roundoff(dtype)
    extra = len(reps) ** 2 + 4  # the additions of the terms, squaring a dense row norm, the clamp
    ks = [[gamma(pair_length(ri, rj) + extra, u) for rj in reps] for ri in reps]
    spacing = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    width = sum(_width(r) for r in reps)
    grids = sum(_grid(r) for r in reps)
    worst = max(max(row) for row in ks)
    return [[k * (1 + k) ** 2 for k in row] for row in ks], spacing * width * (1 + worst) ** 2, spacing * grids


def _grid(rep) -> int:
    """Products of two Gram entries in a ghost norm: G·T² (a lookup: T²; a dense use: none)."""
    kind, t, _, _, g = _lengths(rep)
    return 0 if kind == "dense" else g * t * t


def _width(rep) -> int:
    """Products per entry that can underflow: both factors' features, a dense use's entries."""
    kind, _, r, c, _ = _lengths(rep)
    return rep.grad[0].numel() if kind == "dense" else (r + c if kind == "factored" else c)


def round_up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (float64) in ``dtype``, never below it: rounding to nearest may round down. (No
    tensor from a Python value: on a GPU its copy to the device waits for the queue.)"""
    y = x.to(dtype)
    return torch.where(y < x, torch.nextafter(y, torch.full_like(y, float("inf"))), y)


# a float32 dense norm whose underflow allowance exceeds this share of it is summed in float64
DENSE_LOOSE = 2.0**-20
# float32 dense norms are taken over runs of this many entries: their rounding bound is then
# γ_40 (2.4e-6) whatever the width, at 1.3-1.8x the time of whole-row norms (still ~25x faster
# than a float64 copy on a CPU)
DENSE_CHUNK = 32
# on a GPU (half.LAUNCH_DEVICES) runs this long: CUDA's norm kernel read 32-entry runs at ~0.8 TB/s
# on an H200 (20 ms of GPT-2 small's 106 ms bf16 DP step, profiled 2026-11-28); the bound γ_1032
# (6.2e-5) raises a norm by at most 3.1e-5 of itself
LAUNCH_DENSE_CHUNK = 1024


def dense_chunk(grad: torch.Tensor) -> int:
    """The run length of ``grad``'s float32 dense norm: DENSE_CHUNK, LAUNCH_DENSE_CHUNK on a GPU."""
    return LAUNCH_DENSE_CHUNK if launches_kernels(grad) else DENSE_CHUNK


def dense_sq_norm(grad: torch.Tensor) -> torch.Tensor:
    """Σ g² per sample of ``grad`` (B, ...) in float32, never below the exact value, for float32 and
    half gradients (float64 gradients: their float64 sum, as computed). Float32: the norms of runs
    of k = :func:`dense_chunk` entries (one fused read, no copy), whose squares are summed in float64, plus
    2·n·2⁻¹²⁶ (the squares and partial sums that underflow, n = the row's length), taken
    1 / ((1 − u)²(1 − γ_{k+8})) larger (the extra 8 covers a norm that scales its
    terms, and the float64 squares, sum, root and square, whose errors are far below float32's);
    samples whose bound is loose (DENSE_LOOSE) or not finite, float64 sums of squares. Before
    2026-11-27 every sample was summed in float64: a sample whose entries all square below float32's
    range read 0 in float32 (1.83 R in an audit, tests/test_float_rounding.py)."""
    return dense_sq_norms([grad])[0]


def dense_sq_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`dense_sq_norm` of each of ``grads``, one host read for all of them where no sample needs
    its float64 sum (on a GPU each read waits for the queue: a step of GPT-2 small made 100 of them,
    two per instantiated layer, before commit cb4c181); more only where one does. The float32 ones
    of a device and batch size are bounded, checked and rounded as one stacked tensor: a few
    operators for all of them, not a dozen each (on a GPU each costs a launch)."""
    out: list = [None] * len(grads)
    groups: dict[tuple, list[int]] = {}
    for i, grad in enumerate(grads):
        if grad.dtype == torch.float32:
            groups.setdefault((grad.device, grad.shape[0]), []).append(i)
        elif grad.dtype == torch.float64:
            out[i] = _sq_norm64(grad)
        else:
            out[i] = round_up(_sq_norm64(grad, up=True), torch.float32)
    bounds = [(idx, *_float32_bounds([grads[i] for i in idx])) for idx in groups.values()]
    check = any_flag([redo.any() for _, _, redo in bounds])
    for idx, sq, redo in bounds:
        if check:
            _sum_again(sq, redo, [grads[i] for i in idx])
        for i, row in zip(idx, round_up(sq, torch.float32).unbind(0)):
            out[i] = row
    return out


def runs_sq(grad: torch.Tensor) -> torch.Tensor:
    """The float32 ``grad``'s part of :func:`sq_bounds` (B,): its one read (the tensor may be freed after)."""
    return _runs_sq(grad, dense_chunk(grad))


def any_flag(flags: list[torch.Tensor]) -> bool:
    """Whether any of the device bools ``flags`` is True: one host read per device, not one each."""
    by_device: dict[torch.device, list] = {}
    for f in flags:
        by_device.setdefault(f.device, []).append(f)
    return any(bool(torch.stack(fs).any()) for fs in by_device.values())


def read_flags(flags: list[torch.Tensor]) -> list[bool]:
    """The device bools ``flags`` on the host, in order: one host read per device, not one each
    (a loop of ``bool(flag)`` waits for the queue at every flag). ``tolist`` is no operator: the cost
    trace (benchmarks/cost_trace.py) cannot answer it, so a step reads it only once :func:`any_flag` fired."""
    by_device: dict[torch.device, list[int]] = {}
    for i, f in enumerate(flags):
        by_device.setdefault(f.device, []).append(i)
    out = [False] * len(flags)
    for idx in by_device.values():
        for i, value in zip(idx, torch.stack([flags[i].reshape(()) for i in idx]).tolist()):  # one value each
            out[i] = bool(value)
    return out


def _float32_bounds(grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sq_bounds` of float32 ``grads`` of one batch size and device."""
    k = dense_chunk(grads[0])  # one device
    return sq_bounds([_runs_sq(g, k) for g in grads], [math.prod(g.shape[1:]) for g in grads], k)


def sq_bounds(sqs: list[torch.Tensor], numels: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For float32 gradients of one batch size and device, from their :func:`runs_sq` (``sqs``),
    entries a sample (``numels``) and run length ``k``: (n, B) float64 upper bounds of their
    per-sample sums of squares, and the samples those do not serve (loose or not finite); no host
    read. A run's computed sum ŝ ≥ s(1 − γ_k) − 2k·2⁻¹²⁶ and its norm r̂ ≥ √ŝ (1 − u), so
    s ≤ inflate · (r̂² + 2k·2⁻¹²⁶)."""
    u = unit_roundoff(torch.float32)
    inflate = 1 / ((1 - u) ** 2 * (1 - gamma(k + 8, u)))
    lost = [2 * n * torch.finfo(torch.float32).smallest_normal for n in numels]
    # each gradient's own constant by one multi-tensor operator (no tensor made from host values:
    # on a GPU its copy waits for the queue); the share test is a heuristic for tightness only
    bound = torch.stack(torch._foreach_add(sqs, lost)).mul_(inflate)
    over = torch.stack(torch._foreach_sub(sqs, [x / DENSE_LOOSE for x in lost]))  # width 0: 0, never loose
    return bound, ~(torch.isfinite(bound) & (over >= 0))


def _runs_sq(grad: torch.Tensor, k: int) -> torch.Tensor:
    """Σ over runs of ``k`` entries of each run's float32 norm squared, in float64: (B,)."""
    flat = _rows(grad)
    b, n = flat.shape
    whole = n // k * k
    sq = None
    if whole:  # the runs' norms, then the float64 norm of those (their squares summed, no copy)
        runs = (flat if whole == n else flat[:, :whole]).view(b, whole // k, k)  # B = 0: no -1
        runs = torch.linalg.vector_norm(runs, dim=-1)
        sq = torch.linalg.vector_norm(runs, dim=-1, dtype=torch.float64).square()
    if whole < n or sq is None:
        rest = torch.linalg.vector_norm(flat[:, whole:], dim=-1).double().square()
        sq = rest if sq is None else sq + rest
    return sq


def _sum_again(bound: torch.Tensor, redo: torch.Tensor, grads: list[torch.Tensor]) -> None:
    """Replace, in place, the bounds of the samples ``redo`` marks by float64 sums of squares."""
    for row, grad in enumerate(grads):
        if redo[row].all():  # every sample (all-zero gradients): no gather
            bound[row] = _sq_norm64(grad, up=True)
        elif redo[row].any():
            idx = redo[row].nonzero().squeeze(1)
            bound[row].index_copy_(0, idx, _sq_norm64(grad[idx], up=True))


def _sq_norm64(grad: torch.Tensor, up: bool = False) -> torch.Tensor:
    """Σ g² per sample accumulated in float64: row norms (fused, no squared copy), squares summed
    one dimension at a time. ``up``: taken (1 + γ_{n+3}) larger in float64's unit roundoff, so that
    the float64 rounding of a float32 or half gradient's sum never leaves it below the exact one."""
    if grad.dim() <= 2:
        sq = torch.linalg.vector_norm(_rows(grad), dim=1, dtype=torch.float64).square()
    else:
        sq = sum_per_sample(torch.linalg.vector_norm(grad, dim=-1, dtype=torch.float64).square())
    if not up:
        return sq
    return sq * (1 + gamma(grad[0].numel() + 3 if len(grad) else 3, unit_roundoff(torch.float64)))


def _rows(grad: torch.Tensor) -> torch.Tensor:
    """(B, n): one row per sample (flatten, not reshape: B = 0 on an FSDP rank's empty batch)."""
    return grad.flatten(1) if grad.dim() > 1 else grad.unsqueeze(1)
