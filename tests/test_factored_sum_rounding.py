"""A clipped sum taken from the factors (the ghost path, and the freed instantiation path) rounds
once more than the norm it was clipped by: one float32 product over the sample's T positions.
Under crafted cancellation (positions that cancel to just above the guard's floor, U/256, with
thousands of terms under half an ulp of the running sum) that rounding is multiplied by the clip
factor c ≤ 256 R / U: an independent review (2026-11-28) released 1.001 R at T = 4,096, 1.016 R at
T = 65,536 and 2.93 R at T = 2^20 (one feature, CPU); here 1.008 R at T = 8,192. A held instantiated use sums the very tensor
it normed and releases R. The limitation is documented here as strict xfails (docs/DESIGN.md,
"Not covered") until the factored sums of such samples are made exact.
"""

from __future__ import annotations

import pytest
import torch

from dpzoo.grad_norms import half, param_grad
from dpzoo.grad_norms import reps as R
from dpzoo.grad_norms.param_grad import ParamGrad


def _cancelling(positions: int, pairs: int = 16) -> R.Factored:
    """One sample, one feature: ``pairs`` positions of +1.5, the rest tiny negatives (each under half
    an ulp of the running sum, so a float32 sum in order drops them), ``pairs`` of -1.5(1 - δ), δ
    such that the exact gradient is U / 200 (above the floor U / 256)."""
    tiny, big = 0.99 * 2.0**-24, 1.5
    n = positions - 2 * pairs
    u = 2 * pairs * big + n * tiny
    delta = (u / 200 + n * tiny) / (pairs * big)
    values = torch.cat([torch.full((pairs,), big), torch.full((n,), -tiny), torch.full((pairs,), -big * (1 - delta))])
    left = torch.ones(1, 1, positions, 1)
    return R.Factored(left, values.float().view(1, 1, positions, 1), (1, 1))


def _released(rep: R.Factored, path: str) -> float:
    """‖c · (clipped sum)‖ / R for a clip at a thousandth of the sample's norm (c = R / norm)."""
    g = ParamGrad([rep], ghost=path == "ghost", freed=path == "freed")
    norm = param_grad.total_sq_norms([g])[0].double().sqrt()
    clip = 1e-3 * float(norm[0])
    total = param_grad.clipped_sums({"w": g}, (clip / norm).float(), None)["w"].double()
    return total.norm().item() / clip


def test_a_held_use_releases_at_most_r(monkeypatch):
    monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})
    assert _released(_cancelling(8192, 4), "held") <= 1 + 1e-6


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(
            "ghost", marks=pytest.mark.xfail(strict=True, reason="LIMITATION: factored sum rounding, see module")
        ),
        pytest.param(
            "freed", marks=pytest.mark.xfail(strict=True, reason="LIMITATION: factored sum rounding, see module")
        ),
    ],
)
def test_a_factored_sum_releases_at_most_r_under_crafted_cancellation(path, monkeypatch):
    monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})
    assert _released(_cancelling(8192, 4), path) <= 1 + 2.0**-10  # 1.008 R (2026-11-28)
