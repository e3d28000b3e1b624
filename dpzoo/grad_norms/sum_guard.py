"""The clipped sum's own rounding, made exact where a clip factor could carry it past R.

A use summed from its factors (the ghost path, an instantiation formed for its norm and freed, an
embedding's rows) is a float32 product over each sample's T positions: its rounding on sample i is
up to γ_T · c_i · U_i (U_i = Σ_t ‖L_t‖‖R_t‖ ≥ ‖g_i‖), while the clip only bounds c_i · ‖g_i‖ ≤ R.
Where positions cancel (‖g_i‖ ≪ U_i) the rounding is amplified: an independent review crafted
positions that cancel to U/200 with thousands of terms under half an ulp of the running sum and
released 1.016 R at T = 65,536 and 2.93 R at T = 2^20 (2026-11-28,
tests/test_factored_sum_rounding.py). So a sample with ‖g_i‖ < κ · U_i, κ = γ_{T+2} / SUM_SLACK
(tensor cores: four times the unit roundoff, as :mod:`.formed`), has that parameter's share summed
from its factors in float64 and the other samples' in float32 without it: the rounding of a
sample's own terms then stays below SUM_SLACK · R (c_i ≤ R / ‖g_i‖, and a parameter's ‖g_i‖ is at
most the total norm the clip used). Not covered, on any path (reviews, 2026-11-28): float32
summation itself. The product adds all B·T rows into one running sum, so a sample's terms round
against the other samples' total (1.106 R at B = 997, T = 2,048 with non-cancelling data), and a
sample can carry the running sum over a binade so that every later row rounds up by an ulp (1.96 to
2.0 R at T = 1 to 16 on the freed, ghost and dense paths alike); the float32 total's own rounding
adds u·B of R. Strict xfails in tests/test_factored_sum_rounding.py; the fix (an exact or float64
accumulation, or noise calibrated to what rounding can add) is open. SUM_SLACK is 2⁻⁸ (0.4% of R at most, for any data and any T), not smaller,
so that ordinary data never pays for float64 sums: on MiniLM's real weights and this repository's
text, ‖g_i‖ / U_i ≥ 0.12 for every sample and layer at T = 128 and ≥ 0.07 at T = 512 (measured
2026-11-28), against κ = 0.002 (float32) and 0.008 (bfloat16 on tensor cores) at T = 128, 0.008
and 0.031 at T = 512. At T = 1,024 in bfloat16 on tensor cores (κ = 0.063) ordinary data does pay:
with every use of GPT-2 small on the ghost path, on random tokens, 36 of its 50 parameters sent
all 32 samples to float64 sums (an H200, 2026-11-28, benchmarks/sum_guard_share.py; the timed plan
instantiates every use there, whose dense sums are not guarded). The remaining 2⁻⁸ could be
covered by noise calibrated to (1 + SUM_SLACK) R, and a larger SUM_SLACK by more.
"""

from __future__ import annotations

import functools

import torch

from . import reps as R
from .half import HALF, TENSOR_CORE_DEVICES, shared_scale
from .rounding import gamma, mechanism_dtype, unit_roundoff

__all__ = ["SUM_SLACK", "kappa", "risky_samples", "exact_sum"]


SUM_SLACK = 2.0**-8  # the most a sample's share of a clipped sum may exceed R by, as a share of R


def kappa(rep) -> float:
    """κ of a use: a sample whose norm is below κ · U has its share of the sum in float64; 0 for a
    dense use (its sum is of the very tensor it was normed by)."""
    if isinstance(rep, R.Dense):
        return 0.0
    if isinstance(rep, R.Factored):
        right = R.right_like(rep)  # a lazy use's without forming it
        half_pair = rep.left.dtype == right.dtype and rep.left.dtype in HALF
        return _kappa(
            rep.left.shape[2],
            mechanism_dtype(right.dtype),
            half_pair and rep.left.device.type in TENSOR_CORE_DEVICES,
        )
    return _kappa(rep.index.shape[1], mechanism_dtype(rep.right.dtype), False)


@functools.lru_cache(maxsize=None)
def _kappa(positions: int, dtype: torch.dtype, tensor_cores: bool) -> float:
    u = unit_roundoff(dtype) * (4 if tensor_cores else 1)
    return gamma(positions + 2, u) / SUM_SLACK


def risky_samples(grads: dict) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """({name: the samples (a device bool per sample) whose share of the parameter's clipped sum
    must be summed in float64}, {name: whether any is (a device bool)}) for every parameter with a
    use summed from its factors; no host read: their norms and U (cached where the guard formed
    them) compared at once per device, the flags views of one reduction per device."""
    by_device: dict[torch.device, list] = {}
    for name, g in grads.items():
        if (len(g.reps) == 1 and isinstance(g.reps[0], R.Dense)) or not g.batch_size:  # no factored use, no sample
            continue
        k = max(map(kappa, g.reps))
        if k > 0:
            sq = g.sq_norm()
            by_device.setdefault(sq.device, []).append((name, sq, g.triangle_bound(), k))
    risky: dict[str, torch.Tensor] = {}
    fired: dict[str, torch.Tensor] = {}
    for items in by_device.values():
        names = [name for name, *_ in items]
        bounds = torch.stack(torch._foreach_mul([u for _, _, u, _ in items], [k for *_, k in items]))
        masks = bounds.square_() > torch.stack([sq for _, sq, _, _ in items]).double()
        risky.update(zip(names, masks.unbind(0)))
        fired.update(zip(names, masks.any(1).unbind(0)))
    return risky, fired


def exact_sum(g, scale: torch.Tensor, drop: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    """``g``'s clipped sum (a :class:`~.param_grad.ParamGrad`) with the samples ``rows`` marks summed
    from their factors in float64 (by the scale the float32 sum uses: bfloat16-rounded where it
    is), the others as the step sums them; dropped samples contribute 0 either way."""
    keep = g.clipped_sum(scale, rows if drop is None else drop | rows)
    idx = (rows if drop is None else rows & ~drop).nonzero().squeeze(1)
    shared = shared_scale(g.reps, scale)[idx].double()
    wide = sum(R.clipped_sum(_rows64(r, idx), shared) for r in g.reps)
    return keep + wide.to(keep.dtype)


def _rows64(rep, idx: torch.Tensor):
    """The samples ``idx`` of ``rep``, in float64."""
    if isinstance(rep, R.Dense):
        return R.Dense(rep.grad[idx].double())
    if isinstance(rep, R.Factored):
        return R.Factored(rep.left[idx].double(), rep.right[idx].double(), rep.shape)
    return R.OneHot(rep.index[idx], rep.right[idx].double(), rep.num_rows)
