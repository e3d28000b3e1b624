"""Fewer operators and host reads per DP step where a GPU launches each (issue 30): the Gram chunks
as one batched product, the floating-point guards of every ghost norm with one host read, and the
float32 dense norms bounded as one stacked tensor. Each is exact against float64 brute force and
gives what the one-at-a-time path gives. The GPU paths run here on the CPU by adding "cpu" to
:data:`dpzoo.grad_norms.half.LAUNCH_DEVICES` (the cost report traces them the same way).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpzoo.grad_norms import float_guard, half, param_grad
from dpzoo.grad_norms import reps as R
from dpzoo.grad_norms.param_grad import ParamGrad
from dpzoo.grad_norms.rounding import GRAM_CHUNK, gamma, unit_roundoff


def _grad64(rep: R.Factored) -> torch.Tensor:
    return torch.einsum("bgtr,bgtc->bgrc", rep.left.double(), rep.right.double()).flatten(1)


def _bound(rep: R.Factored, k: int) -> torch.Tensor:
    """γ of the chunked Gram's chains times Σ_{t,s} |L_t||L_s||R_t||R_s|: what float32 may be off by."""
    n = min(k, GRAM_CHUNK) + -(-k // GRAM_CHUNK) + 4
    u = rep.left.double().norm(dim=-1) * rep.right.double().norm(dim=-1)
    return 3 * gamma(n, unit_roundoff(torch.float32)) * u.flatten(1).sum(1).square()


@pytest.mark.parametrize("k, t", [(512, 3), (700, 17), (1000, 1), (2304, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gram_chunks_in_one_batched_product_give_the_exact_norm_and_cross_term(k, t, dtype, monkeypatch):
    gen = torch.Generator().manual_seed(k + t)
    b, g, c = 3, 2 if t < 100 else 1, 200
    u = R.Factored(*(torch.randn(b, g, t, n, generator=gen).to(dtype) for n in (k, c)), (g, k, c))
    v = R.Factored(torch.randn(b, g, t, k, generator=gen).to(dtype), -0.7 * u.right, (g, k, c))
    loop_sq, loop_inner = R.sq_norm(u, ghost=True), R.inner(u, v, ghost=True)
    products = []
    real = R.product
    monkeypatch.setattr(R, "product", lambda x, y: products.append(x.shape) or real(x, y))
    monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})
    got_sq, got_inner = R.sq_norm(u, ghost=True).double(), R.inner(u, v, ghost=True).double()
    exact_sq, exact_inner = _grad64(u).square().sum(1), (_grad64(u) * _grad64(v)).sum(1)
    bound = _bound(u, k) + _bound(v, k)
    assert ((got_sq - exact_sq).abs() <= bound).all() and ((got_inner - exact_inner).abs() <= bound).all()
    assert torch.allclose(got_sq, loop_sq.double(), rtol=1e-5) and torch.allclose(
        got_inner, loop_inner.double(), rtol=1e-4, atol=1e-3 * bound.max().item()
    )
    if t > 1:  # one batched product per wide Gram (the norm's, the cross term's), not one per chunk
        whole = [s for s in products if s[-1] == GRAM_CHUNK]
        assert len(whole) == 2 and all(s[0] == b * g * (k // GRAM_CHUNK) for s in whole), products
    guarded = ParamGrad([u, v], ghost=True).sq_norm().double()
    assert (guarded >= (_grad64(u) + _grad64(v)).square().sum(1)).all()


def _ghost_params(gen: torch.Generator, n: int) -> list[ParamGrad]:
    shapes = [(5, 30, 20), (3, 40, 1), (7, 9, 33), (2, 64, 64)]
    return [
        ParamGrad([R.Factored(torch.randn(4, 1, t, r, generator=gen), torch.randn(4, 1, t, c, generator=gen), (1, r, c))], ghost=True)
        for t, r, c in shapes[:n]
    ]  # fmt: skip


def _counting_reads(monkeypatch, reads: list) -> None:
    for name in ("__bool__", "item", "tolist"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _r=real, _n=name: reads.append(_n) or _r(t, *a))


@pytest.mark.parametrize(
    "fire", ["none", "zero rows", "cancelling", "tiny rows", "huge rows", "inf", "tiny float64 rows"]
)
def test_every_ghost_guard_of_a_step_costs_one_host_read_and_equals_the_guard_one_by_one(fire, monkeypatch):
    """On a GPU, total_sq_norms guards every ghost-path parameter with one host read where none
    needs its float64 norm or a rescaled row (zero rows, the last position of a causal LM, need
    neither); where one does (cancelling positions, values whose float32 Grams under- or overflow,
    a non-finite value, float64 rows near the limits of squaring), that parameter is guarded again alone. Each result equals
    ParamGrad.sq_norm's and is never below the exact squared norm."""
    monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})
    gen = torch.Generator().manual_seed(3)
    grads = _ghost_params(gen, 4)
    rep = grads[1].reps[0]
    if fire == "cancelling":  # a sample's positions cancel to 1e-4 of their size
        rep.left[2, 0, :] = rep.left[2, 0, 0]
        rep.right[2, 0, 1], rep.right[2, 0, 2] = -(1 - 1e-4) * rep.right[2, 0, 0], 0
    elif fire == "tiny rows":
        rep.left[0] *= 1e-25
    elif fire == "huge rows":
        rep.right[3] *= 1e25
    elif fire == "zero rows":
        for g in grads:
            g.reps[0].right[:, :, -1] = 0
    elif fire == "inf":
        rep.left[1, 0, 0, 0] = float("inf")
    elif fire == "tiny float64 rows":  # normed in float64 and near its limits: rescaled, not recomputed
        grads = [
            ParamGrad([R.Factored(r.left.double(), r.right.double(), r.shape)], ghost=True)
            for g in grads
            for r in g.reps
        ]
        grads[1].reps[0].left[0] *= 1e-25
    one_by_one = [ParamGrad(g.reps, ghost=True).sq_norm() for g in grads]
    reads: list = []
    _counting_reads(monkeypatch, reads)
    total = param_grad.total_sq_norms(grads)
    counted = list(reads)
    quiet = fire in ("none", "zero rows")
    assert not quiet or counted == ["__bool__"], counted
    assert quiet or len(counted) > 1  # the one that fired was guarded again
    for got, expected, g in zip(total, one_by_one, grads):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
        exact = _grad64(g.reps[0]).square().sum(1)
        ok = torch.isfinite(exact)
        assert (got.double()[ok] >= exact[ok]).all()


def test_a_guard_that_does_not_fire_is_the_checked_guard(monkeypatch):
    """guards' unchecked result (no host read) is what the guard with its reads computes, for
    several uses, a lookup and a dense use together."""
    gen = torch.Generator().manual_seed(5)
    f = R.Factored(torch.randn(3, 1, 6, 10, generator=gen), torch.randn(3, 1, 6, 8, generator=gen), (1, 10, 8))
    onehot = R.OneHot(torch.randint(0, 10, (3, 4), generator=gen), torch.randn(3, 4, 8, generator=gen), 10)
    dense = R.Dense(torch.randn(3, 10, 8, generator=gen))
    items = []
    for reps in ([f], [f, onehot], [f, dense]):
        total = sum(R.sq_norm(r, ghost=True) for r in reps).clamp_min(0)
        items.append((reps, total))
    batched = float_guard.guards(items)
    for (reps, total), got in zip(items, batched):
        assert torch.equal(got, float_guard.guard(reps, total))


@pytest.mark.parametrize("lose", [False, True])
def test_every_clipped_sum_of_a_step_costs_one_host_read_and_equals_the_sum_one_by_one(lose, monkeypatch):
    """On a GPU, clipped_sums checks every scaled factor's bits with one host read; a parameter whose
    scaled factor lost bits (values below 2⁻¹¹⁸ after scaling, bfloat16; below float32's smallest
    normal, float32) is summed again alone in float64. Each sum equals ParamGrad.clipped_sum's and
    the float64 brute force Σ_i s_i g_i within float32 rounding."""
    monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})
    gen = torch.Generator().manual_seed(6)
    b = 5
    grads = {}
    for name, dtype, (t, r, c) in [
        ("a", torch.bfloat16, (3, 20, 30)),
        ("b", torch.float32, (4, 12, 7)),
        ("c", torch.bfloat16, (2, 9, 16)),
    ]:
        left, right = torch.randn(b, 1, t, r, generator=gen).to(dtype), torch.randn(b, 1, t, c, generator=gen).to(dtype)
        grads[name] = ParamGrad([R.Factored(left, right, (1, r, c))], ghost=True)
    if lose:
        grads["a"].reps[0].left[1] *= 2.0**-125
        grads["b"].reps[0].left[2, 0, 0] = 1e-39  # a subnormal: scaled, it loses bits
    scale = half.round_toward_zero(torch.rand(b, generator=gen) + 0.1, torch.bfloat16)
    one_by_one = {n: g.clipped_sum(scale) for n, g in grads.items()}
    param_grad.total_sq_norms(list(grads.values()))  # as a step does before its sums
    reads: list = []
    _counting_reads(monkeypatch, reads)
    got = param_grad.clipped_sums(grads, scale, None)
    counted = list(reads)
    assert counted == ["__bool__"] if not lose else counted[:2] == ["__bool__", "tolist"], counted  # then its own sum
    for name, g in grads.items():
        torch.testing.assert_close(got[name], one_by_one[name], rtol=0, atol=0)
        rep = g.reps[0]
        exact = torch.einsum("b,btr,btc->rc", scale.double(), rep.left[:, 0].double(), rep.right[:, 0].double())
        torch.testing.assert_close(got[name].double().view_as(exact), exact, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("launch", [False, True])
def test_a_clipped_sum_that_does_not_fit_is_refused_naming_its_parameter(launch, monkeypatch):
    from dpzoo.errors import UnsupportedModuleError

    if launch:
        monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})
    bad = ParamGrad([R.Factored(torch.randn(2, 1, 3, 4), torch.randn(2, 1, 5, 6), (1, 4, 6))], ghost=True)
    with pytest.raises(UnsupportedModuleError, match="clipped sum of blocks.0.weight failed"):
        param_grad.clipped_sums({"blocks.0.weight": bad}, torch.ones(2), None)


@pytest.mark.parametrize("change", [None, "running", "mask", "nan"])
def test_the_buffer_watch_reads_the_host_once_and_names_what_changed(change, monkeypatch):
    """StateWatch compares every buffer on the device with one host read (torch.equal read once per
    buffer: 4 of a llama step's 6 reads); a changed one is named (a value set to NaN included)."""
    from dpzoo.errors import PrivacyUsageError
    from dpzoo.privacy.guards import StateWatch

    model = nn.Linear(3, 3)
    model.register_buffer("running", torch.zeros(4))
    model.register_buffer("mask", torch.ones(2, 2, dtype=torch.bool))
    model.register_buffer("inv_freq", torch.arange(5.0))
    watch = StateWatch(model)
    watch.start_forward(first_step=False)
    if change == "running":
        model.running.data[1] = 0.5
    elif change == "mask":
        model.mask[0, 1] = False
    elif change == "nan":
        model.inv_freq[2] = float("nan")
    reads: list = []
    _counting_reads(monkeypatch, reads)
    if change is None:
        watch.compare_buffers("the step")
        assert list(reads) == ["__bool__"], reads
        return
    with pytest.raises(PrivacyUsageError, match=f"Buffer\\(s\\) {'inv_freq' if change == 'nan' else change} changed"):
        watch.compare_buffers("the step")


@pytest.mark.parametrize("launch", [False, True])
def test_uses_that_cancel_share_one_scale_when_a_mixed_dtype_factor_loses_bits(launch, monkeypatch):
    """A factored use with a bfloat16 and a float32 factor whose scaled factor loses bits is summed
    in float64 by the same (float32-rounded) scale as its working path and as the parameter's other
    uses, so uses that cancel still give 0 (a review found -819 from a bfloat16-rounded scale)."""
    if launch:
        monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})
    left = torch.tensor([[[[1.0], [2.0**-130]]]], dtype=torch.bfloat16)
    right = torch.tensor([[[[2.0**20, 3.0], [1.0, 1.0]]]])
    fac = R.Factored(left, right, (1, 1, 2))
    g = torch.einsum("btr,btc->brc", left[:, 0].float(), right[:, 0])
    grads = {"w": ParamGrad([fac, R.Dense(-g.view(1, 1, 1, 2))], ghost=True)}
    got = param_grad.clipped_sums(grads, torch.tensor([0.7]), None)["w"]
    assert got.abs().max() < 1e-6, got


def test_the_buffer_watch_refuses_a_dtype_change_a_signed_zero_and_a_quantized_rescale():
    """Channels a value comparison misses (found by a review): a buffer replaced by one of another
    dtype, 0.0 turned into -0.0, a quantized buffer whose scale changed (equal dequantized values)."""
    from dpzoo.errors import PrivacyUsageError
    from dpzoo.privacy.guards import StateWatch

    for change in ("dtype", "zero", "quantized"):
        model = nn.Linear(2, 2)
        model.register_buffer("b", torch.zeros(4))
        if change == "quantized":
            model.b = torch.quantize_per_tensor(torch.zeros(4), 1.0, 0, torch.quint8)
        watch = StateWatch(model)
        watch.start_forward(first_step=False)
        if change == "dtype":
            model.b = torch.zeros(4, dtype=torch.float64)
        elif change == "zero":
            model.b[2] = -0.0
        else:
            model.b = torch.quantize_per_tensor(torch.zeros(4), 0.123456789, 0, torch.quint8)
        with pytest.raises(PrivacyUsageError, match="Buffer"):
            watch.compare_buffers("the step")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gpu_row_norm_of_the_guard_is_an_upper_bound_read_once_without_a_float64_copy(dtype, monkeypatch):
    """The guard's row norms on a GPU: float32 in one read (no float64 copy of the rows: CUDA reduces
    half rows into float32 in the kernel; a float64 norm copies them first), never below the exact
    norm, within γ_{k+8} (1.8e-5 here) above it on ordinary rows; nothing marked (no host read): rows
    whose squares overflow read inf (the guard recomputes their samples), and are rescaled to their
    exact norm where asked."""
    from torch.utils._python_dispatch import TorchDispatchMode

    monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})
    gen = torch.Generator().manual_seed(7)
    t = torch.randn(6, 9, 300, generator=gen).to(dtype)
    t[0, 0] = 0  # the last position of a causal LM
    t[0, 1] = (torch.randn(300, generator=gen) * 1e-30).to(dtype)  # squares underflow in float32
    t[1, 2] = (torch.randn(300, generator=gen) * 1e25).to(dtype)  # squares overflow in float32
    t[1, 3, 5] = float("inf")
    exact = t.double().norm(dim=-1)

    class Copies(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dtype == torch.float64 and out.numel() >= t.numel():
                seen.append(str(func))
            return out

    def row_norms(rescale: bool) -> tuple:  # one position per sample: A = Σ_t ‖L_t‖ is the row's norm
        rows = R.Factored(t.reshape(-1, 1, 1, 300), torch.ones(54, 1, 1, 2, dtype=dtype), (1, 300, 2))
        _, norms, _, risky = float_guard.row_sums(rows, rescale)
        return norms.view(6, 9), risky

    seen: list = []
    with Copies():
        n, risky = row_norms(False)
    assert not seen, seen
    assert risky is None  # overflowed rows are inf, which the guard recomputes: no mark, no host read
    assert torch.isinf(n[1, 2]) and torch.isinf(n[1, 3])
    ok = torch.isfinite(exact) & (exact < 2.0**60)
    assert (n[ok] >= exact[ok]).all()
    big = ok & (exact > 1)
    assert (n[big] <= exact[big] * (1 + 2 * gamma(300 + 8, unit_roundoff(torch.float32)))).all()
    assert (n[0, :2] < 1e-20).all()  # loose by the underflow allowance only
    rescaled, _ = row_norms(True)
    assert exact[1, 2] <= rescaled[1, 2] <= exact[1, 2] * (1 + 2 * gamma(300 + 8, unit_roundoff(torch.float32)))
    assert torch.isinf(rescaled[1, 3])
