"""A clipped sum taken from the factors (the ghost path, the freed instantiation path, an embedding's
rows) rounds once more than the norm it was clipped by: one float32 product over the sample's T
positions. Under crafted cancellation (positions that cancel to just above the guard's floor, U/256,
with thousands of terms under half an ulp of the running sum) that rounding is multiplied by the clip
factor c ≤ 256 R / U: an independent review (2026-11-28) released 1.001 R at T = 4,096, 1.016 R at
T = 65,536 and 2.93 R at T = 2^20, and this file's sample 1.008 R at T = 8,192, before
:mod:`dpzoo.grad_norms.sum_guard` summed such samples' shares in float64. Every released share is
checked against R and the sums against float64 brute force; ordinary data never takes the float64 sum.
"""

from __future__ import annotations

import pytest
import torch
from grad_reference import count_host_reads

from dpzoo.grad_norms import half, param_grad, rounding, sum_guard
from dpzoo.grad_norms import reps as R
from dpzoo.grad_norms.param_grad import ParamGrad

SLACK = 1 + sum_guard.SUM_SLACK


def _cancelling(positions: int, pairs: int = 4, dtype=torch.float32, width: int = 1) -> torch.Tensor:
    """One sample's position values: ``pairs`` of +1.5, the rest tiny negatives (each under half an
    ulp of the running sum, so a float32 sum in order drops them), ``pairs`` of -1.5(1 - δ), δ such
    that the exact gradient is U / 200 (above the floor U / 256)."""
    tiny, big = 0.99 * 2.0**-24, 1.5
    n = positions - 2 * pairs
    u = 2 * pairs * big + n * tiny
    delta = (u / 200 + n * tiny) / (pairs * big)
    return torch.cat([torch.full((pairs,), big), torch.full((n,), -tiny), torch.full((pairs,), -big * (1 - delta))])


def _factored(values: list[torch.Tensor], width: int = 1) -> R.Factored:
    """Samples whose positions carry ``values`` on one feature of ``width``."""
    t = values[0].numel()
    left = torch.zeros(len(values), 1, t, width)
    left[..., 0] = 1
    right = torch.zeros(len(values), 1, t, width)
    right[:, 0, :, 0] = torch.stack(values).float()
    return R.Factored(left, right, (width, width))


def _released(grads: dict, norms: torch.Tensor, exact: dict) -> torch.Tensor:
    """Per sample, ‖c_i · g_i‖ / R as released, for a clip at a thousandth of the smallest norm (c_i
    = R / ‖g_i‖): each sample's share measured as the sum with it minus the sum without it is not
    what rounding allows, so each sample is summed alone, as the step sums it with the others."""
    clip = 1e-3 * float(norms.min())
    scale = (clip / norms).float()
    out = []
    for i in range(len(norms)):
        only = scale * (torch.arange(len(norms)) == i)
        total = param_grad.clipped_sums(grads, only, None)
        out.append(sum(t.double().square().sum() for t in total.values()).sqrt().item() / clip)
        for name, t in total.items():  # and within float32 rounding of the float64 brute force
            want = float(only[i]) * exact[name][i]
            assert (t.double() - want).norm() <= sum_guard.SUM_SLACK * want.norm() + 1e-30
    return torch.tensor(out)


@pytest.mark.parametrize("path", ["held", "ghost", "freed"])
@pytest.mark.parametrize("positions", [8192, 20000])
def test_no_sample_releases_more_than_r_under_crafted_cancellation(path, positions, monkeypatch):
    """A crafted sample: its released share at most (1 + SUM_SLACK) R on every
    path, and within SUM_SLACK of the float64 brute force (1.008 R at T = 8,192 on the ghost and freed
    paths before the float64 sums)."""
    monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})
    rep = _factored([_cancelling(positions)])  # alone: this CPU's product then adds its positions in order
    if path == "ghost" and positions > 10000:
        pytest.skip("the ghost norm's T x T Grams: 1.6 GB at T = 20,000")
    g = ParamGrad([rep], ghost=path == "ghost", freed=path == "freed")
    norms = param_grad.total_sq_norms([g])[0].double().sqrt()
    exact = {"w": torch.einsum("btr,btc->brc", rep.left[:, 0].double(), rep.right[:, 0].double())}
    if path == "held":  # it sums the float32 gradient it formed and normed, not the exact one
        exact = {"w": R.instantiate(rep).double()}
    released = _released({"w": g}, norms, exact)
    assert (released <= SLACK).all(), released


def test_a_stack_member_and_an_embedding_with_a_cancelling_sample_are_summed_exactly(monkeypatch):
    """On a GPU's stacked sums (three uses of one shape) and an embedding's rows (positions on one
    token that cancel), the crafted sample's shares stay within R; the others' sums are untouched."""
    monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})
    t = 8192
    gen = torch.Generator().manual_seed(1)
    small = lambda: 1e-4 * torch.randn(t, generator=gen)  # noqa: E731  # the crafted shares dominate the total norm
    ordinary = [_factored([small(), small()]) for _ in range(2)]
    crafted = _factored([_cancelling(t), torch.randn(t, generator=gen)])
    rows = torch.stack([_cancelling(t), small()]).float().unsqueeze(-1)  # one feature
    lookup = R.OneHot(torch.zeros(2, t, dtype=torch.long), rows, 3)  # every position on token 0
    reps = {"a": ordinary[0], "b": crafted, "c": ordinary[1], "emb": lookup}
    grads = {n: ParamGrad([r], ghost=True) for n, r in reps.items()}
    norms = torch.stack(param_grad.total_sq_norms(list(grads.values()))).double().sum(0).sqrt()
    exact = {
        n: R.instantiate(R.Factored(r.left.double(), r.right.double(), r.shape)) for n, r in reps.items() if n != "emb"
    }
    exact["emb"] = R.instantiate(R.OneHot(lookup.index, rows.double(), 3))
    assert (_released(grads, norms, exact) <= SLACK).all()


def test_every_amplified_parameter_is_found_with_one_host_read(monkeypatch):
    """Three parameters, two with a crafted sample (first and third), on a GPU's path: the sums read
    the host twice (whether any flag fired, then every parameter's flags at once; a read per
    parameter waited for the queue at each: 36 at GPT-2 T1024 in bfloat16, 2026-11-28), and exactly
    the two are summed in float64, each for its crafted sample alone."""
    monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})
    t = 8192
    gen = torch.Generator().manual_seed(3)
    plain = lambda: torch.rand(t, generator=gen)  # noqa: E731  # positions of one sign: nothing cancels
    values = [[_cancelling(t), plain()], [plain(), plain()], [plain(), _cancelling(t)]]
    grads = {n: ParamGrad([_factored(v)], ghost=True) for n, v in zip("abc", values)}
    param_grad.total_sq_norms(list(grads.values()))
    calls = []
    real = sum_guard.exact_sum
    monkeypatch.setattr(sum_guard, "exact_sum", lambda g, *a: calls.append((g, a[-1].tolist())) or real(g, *a))
    reads = count_host_reads(monkeypatch)
    param_grad.clipped_sums(grads, torch.full((2,), 0.5), None)
    assert reads[:2] == ["__bool__", "tolist"] and reads.count("tolist") == 1 + len(calls), reads  # then the test's own
    assert [(g, rows) for g, rows in calls] == [(grads["a"], [True, False]), (grads["c"], [False, True])]


def test_read_flags_reads_each_flag_as_its_one_value():
    """0-dim and 1-element flags, bool and not, in order (a 1-element False stacked to (n, 1) read as
    the non-empty list [False], true, before: found by the review of 2026-11-28); a flag of two values is refused."""
    flags = [torch.tensor(False), torch.tensor([True]), torch.tensor([False]), torch.tensor(1.0), torch.tensor([0])]
    assert rounding.read_flags(flags) == [False, True, False, True, False]
    assert rounding.read_flags([]) == []
    with pytest.raises(RuntimeError):
        rounding.read_flags([torch.tensor([True, False])])


def test_ordinary_data_never_takes_the_float64_sum(monkeypatch):
    """Random positions (‖g‖ ≈ U/√T) in float32 and bfloat16 at T up to 1,024: no sample is summed in
    float64, and the step's sums read the host once."""
    monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})
    calls = []
    monkeypatch.setattr(sum_guard, "exact_sum", lambda *a: calls.append(a))
    gen = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        for t in (16, 128, 1024):
            left = torch.randn(8, 1, t, 24, generator=gen).to(dtype)
            right = torch.randn(8, 1, t, 40, generator=gen).to(dtype)
            grads = {"w": ParamGrad([R.Factored(left, right, (24, 40))], ghost=True)}
            param_grad.total_sq_norms(list(grads.values()))
            risky, _ = sum_guard.risky_samples(grads)
            assert not risky["w"].any(), (dtype, t)
            param_grad.clipped_sums(grads, torch.rand(8, generator=gen), None)
    assert calls == []


def test_kappa_grows_with_positions_and_tensor_cores():
    """κ = γ_{T+2} / SUM_SLACK: linear in T, four times larger where the sum runs on tensor cores,
    0 for a dense use (summed from the tensor it was normed by)."""
    rep = lambda t, dtype: R.Factored(torch.ones(1, 1, t, 2, dtype=dtype), torch.ones(1, 1, t, 3, dtype=dtype), (2, 3))  # noqa: E731
    assert sum_guard.kappa(R.Dense(torch.ones(2, 3))) == 0
    k128, k1024 = sum_guard.kappa(rep(128, torch.float32)), sum_guard.kappa(rep(1024, torch.float32))
    assert 7.5 < k1024 / k128 < 8.5 and 0.0019 < k128 < 0.0021
    assert sum_guard.kappa(rep(128, torch.float64)) < 1e-10


@pytest.mark.xfail(
    strict=True,
    reason="LIMITATION of float32 summation on every path (reviews, 2026-11-28): one product adds all B·T rows "
    "into one running sum, so a sample's terms round against the other samples' total; its share f(D) - f(D "
    "without it) reaches 1.106 R at B 997, T 2048 here, and a sample that carries the running sum over a binade "
    "makes every later row round up (1.96-2.0 R at T 1-16, the dense path too). Blocks of rows do not fix the "
    "second; an exact or float64 accumulation, or noise calibrated to the rounding, is open",
)
def test_a_samples_share_of_a_long_sum_is_not_rounded_against_the_others(monkeypatch):
    """Non-cancelling samples (‖g‖ = U, nothing for sum_guard to mark), one feature: the others put the
    running sum where each of the last sample's T terms, (k + 0.52) ulp of it, rounds up by half an
    ulp; its share is measured as the sum with it minus the sum without it (a drop mask)."""
    monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})
    t, k = 2048, 4
    clip = (k + 0.52) * 2.0**-23 * t  # R; n · R lands in [1, 2)
    n = int(1.1 / clip)
    ones = torch.ones(n + 1, 1, t, 1)
    g = ParamGrad([R.Factored(ones, ones.clone(), (1, 1))], ghost=False, freed=True)
    norms = param_grad.total_sq_norms([g])[0].double().sqrt()
    scale = (clip / norms).clamp(max=1).float()
    drop = torch.zeros(n + 1, dtype=torch.bool)
    drop[-1] = True
    share = param_grad.clipped_sums({"w": g}, scale, None)["w"] - param_grad.clipped_sums({"w": g}, scale, drop)["w"]
    assert share.double().norm().item() / clip <= SLACK


@pytest.mark.parametrize("launch", [False, True], ids=["cpu", "launched"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lost_bits_says_whether_a_scaled_value_left_the_normal_range_where_its_factor_is_not_zero(
    dtype, launch, monkeypatch
):
    """half.lost_bits against its definition, element by element (|scaled| below tiny where narrow is
    not 0, or scaled not finite), on values at the edges: zeros of either sign, subnormals, float32's
    maximum, infinities, NaNs, scales of 0 and inf; the CPU's reductions and the launched route alike."""
    if launch:
        monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})
    gen = torch.Generator().manual_seed(3)
    edges = torch.tensor([0.0, -0.0, 1.0, -2.5, 1e-39, 1e-45, 3e38, float("inf"), float("-inf"), float("nan"), 1e-20])
    tiny = torch.finfo(torch.float32).tiny
    fired = 0
    for _ in range(400):
        shape = (int(torch.randint(0, 4, (), generator=gen)), 1, int(torch.randint(1, 4, (), generator=gen)), 2)
        narrow = torch.randn(shape, generator=gen) * 10.0 ** float(torch.randint(-30, 30, (), generator=gen))
        pick = torch.rand(shape, generator=gen) < 0.2
        narrow = torch.where(pick, edges[torch.randint(0, len(edges), shape, generator=gen)], narrow).to(dtype)
        scale = torch.tensor([0.0, 1.0, 1e-30, 1e30, float("inf"), 0.5])[
            torch.randint(0, 6, (shape[0], 1, 1, 1), generator=gen)
        ]
        scaled = narrow.float() * scale
        expected = bool((((scaled.abs() < tiny) & (narrow != 0)) | ~torch.isfinite(scaled)).any())
        got = half.lost_bits(narrow, scaled, tiny)
        assert got.dtype == torch.bool and got.dim() == 0 and bool(got) == expected
        fired += expected
    assert 50 < fired < 350  # both answers were checked many times
