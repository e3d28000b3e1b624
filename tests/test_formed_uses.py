"""On a GPU, a single use on the instantiation path is formed for its norm and freed, its clipped sum
taken from its factors (issue 30: the held per-sample gradients were 3.05x the non-private peak of
GPT-2 small). The norm must bound the exact gradient the factored sum adds, not only the formed
one: against float64 brute force with rows whose float32 product loses bits, cancels, underflows,
overflows or is infinite; never more than one formed gradient alive; the planner's budget no
longer shared by them; end to end through zoo models. The GPU paths run here on the CPU by adding
"cpu" to :data:`dpzoo.grad_norms.half.LAUNCH_DEVICES`.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from grad_reference import check_against_brute_force, count_host_reads, grad64, random_factored, zoo_model_and_inputs
from torch.utils._python_dispatch import TorchDispatchMode

from dpzoo.grad_norms import attach_norm_hooks, cost, float_guard, formed, half, param_grad
from dpzoo.grad_norms import reps as R
from dpzoo.grad_norms.param_grad import ParamGrad

B = 4
SHAPES = [(6, 20, 12)] * 3 + [(9, 7, 17)] * 2


def _reps(dtype: torch.dtype, seed: int = 0) -> list[R.Factored]:
    return random_factored(SHAPES, B, dtype, seed)


def _exact(rep: R.Factored) -> torch.Tensor:
    return grad64(rep).flatten(1).square().sum(1)


def _spoil(rep: R.Factored, how: str) -> None:
    if how == "cancelling":  # sample 1's positions cancel to 1e-4 of their size
        rep.left[1, 0, :] = rep.left[1, 0, 0]
        rep.right[1, 0, 1], rep.right[1, 0, 2:] = -(1 - 1e-4) * rep.right[1, 0, 0], 0
    elif how == "tiny":  # float32 products underflow
        rep.left[0] *= 1e-25
        rep.right[0] *= 1e-20
    elif how == "huge":  # squares overflow
        rep.right[3] *= 1e25
    elif how == "inf":
        rep.left[2, 0, 0, 0] = float("inf")
    elif how == "zero":
        rep.left[0] = 0


@pytest.mark.parametrize("how", ["none", "cancelling", "tiny", "huge", "inf", "zero"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_formed_norms_are_never_below_the_exact_norm(how, dtype, monkeypatch):
    """Every sample's squared norm is at least the float64 brute force of its factors and, for
    ordinary rows, within 0.1% of it; a quiet step reads the host once for every use; the factors
    are kept for the sum (nothing dense held)."""
    if dtype == torch.bfloat16 and how in ("tiny", "huge"):
        pytest.skip("bfloat16 shares float32's exponent range: the float32 cases cover it")
    reps = _reps(dtype)
    _spoil(reps[1], how)
    monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})
    grads = [ParamGrad([r], ghost=False, freed=True) for r in reps]
    reads = count_host_reads(monkeypatch)
    got = param_grad.total_sq_norms(grads)
    assert (reads == ["__bool__"]) == (how == "none"), reads
    for g, norm, rep in zip(grads, got, reps):
        assert norm is g.sq_norm() and norm.dtype == torch.float32
        assert g.reps == [rep]  # its factors, not a held dense gradient
        exact = _exact(rep)
        ok = torch.isfinite(exact)
        assert (norm.double()[ok] >= exact[ok]).all(), (how, norm, exact)
        ordinary = ok & (exact > 1e-3) & (exact < torch.finfo(torch.float32).max)  # past it: inf
        if how != "cancelling":
            assert (norm.double()[ordinary] <= exact[ordinary] * 1.001).all()
    if how == "inf":
        assert not torch.isfinite(got[1][2])
    if how in ("tiny", "zero"):  # recomputed in float64: not the float32 underflow allowance (~1e-35)
        assert got[1][0] <= 1e-40 and (how == "tiny" or got[1][0] == 0)


def test_a_float32_product_that_loses_its_small_terms_is_taken_up_by_its_error_bound(monkeypatch):
    """A sum of one 1 and 4095 terms just below half a float32 ulp of 1: added in order, the formed
    gradient reads 1 where the exact is 1.00024; its own norm would release the sample at
    (1 - 2.4e-4) of its norm. The product's error bound (γ_T · U) must cover it without a float64
    recompute (the bound raises the norm by far less than LOOSE)."""
    monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})
    left = torch.full((2, 1, 4096, 3), 0.99 * 2.0**-24)
    left[:, 0, 0] = 1
    rep = R.Factored(left, torch.ones(2, 1, 4096, 5), (3, 5))
    lost = R.instantiate(rep).flatten(1).square().sum(1).double()
    exact = _exact(rep)
    reads = count_host_reads(monkeypatch)
    norm = param_grad.total_sq_norms([ParamGrad([rep], ghost=False, freed=True)])[0]
    assert reads == ["__bool__"]  # not recomputed: the bound alone
    assert (norm.double() >= exact).all() and (norm.double() <= exact * 1.001).all()
    if (lost < exact * (1 - 1e-4)).all():  # this CPU's product added in order, as CUDA's may
        assert (norm.double() > lost * (1 + 4e-4)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_product_error_bound_covers_the_formed_gradient(dtype):
    """e ≥ ‖g − g̃‖ for random, wide-ranging and lost-term factors (the bound the norm relies on)."""
    gen = torch.Generator().manual_seed(3)
    for trial in range(20):
        t, p, d = [int(x) for x in torch.randint(1, 300, (3,), generator=gen)]
        left = torch.randn(B, 1, t, p, generator=gen) * torch.exp(4 * torch.randn(B, 1, t, 1, generator=gen))
        right = torch.randn(B, 1, t, d, generator=gen)
        if trial % 3 == 0:
            left[:, :, 1:] *= 2.0**-23
        rep = R.Factored(left.to(dtype), right.to(dtype), (p, d))
        err = (R.instantiate(rep).double() - grad64(rep)).flatten(1).norm(dim=1)
        u = float_guard.row_sums(rep)[0]
        assert (formed.product_error(rep, u, torch.float32) >= err).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clipped_sums_of_formed_uses_come_from_their_factors(dtype, monkeypatch):
    """After the formed norms, each clipped sum is the factored one (what the ghost path adds, stacked
    with its shape), within float32 rounding of Σ_i s_i g_i in float64."""
    monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})
    reps = _reps(dtype, seed=4)
    scale = half.round_toward_zero(torch.rand(B, generator=torch.Generator().manual_seed(5)) + 0.1, torch.bfloat16)
    grads = {str(i): ParamGrad([r], ghost=False, freed=True) for i, r in enumerate(reps)}
    param_grad.total_sq_norms(list(grads.values()))
    sums = param_grad.clipped_sums(grads, scale, None)
    for i, rep in enumerate(reps):
        want = torch.einsum("b,brc->rc", scale.double(), grad64(rep))
        assert (sums[str(i)].double() - want).abs().max() <= 1e-5 * want.abs().max()
        torch.testing.assert_close(sums[str(i)], ParamGrad([rep], ghost=True).clipped_sum(scale), rtol=1e-5, atol=1e-6)


class _Formed(TorchDispatchMode):
    """Watches every float32 tensor of ``numel`` entries made (views included): the most storages
    alive at once, and :meth:`storages` alive now."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.alive, self.most = numel, [], 0

    def storages(self) -> int:
        return len({ptr for w, ptr in self.alive if w() is not None})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.numel() == self.numel and out.dtype == torch.float32:
            self.alive.append((weakref.ref(out), out.untyped_storage().data_ptr()))
            self.most = max(self.most, self.storages())
        return out


@pytest.mark.parametrize("launch, freed", [(True, True), (True, False), (False, True)])
def test_one_formed_gradient_is_alive_at_a_time(launch, freed, monkeypatch):
    """Five uses of one shape: on a GPU, ``freed``, at most one formed gradient alive during the
    norms and none after; held (not ``freed``, or on a CPU) all five until the clipped sum."""
    if launch:
        monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})
    gen = torch.Generator().manual_seed(6)
    reps = [R.Factored(torch.randn(B, 1, 5, 24, generator=gen), torch.randn(B, 1, 5, 40, generator=gen), (24, 40)) for _ in range(5)]  # fmt: skip
    grads = [ParamGrad([r], ghost=False, freed=freed) for r in reps]
    with _Formed(B * 24 * 40) as watch:
        param_grad.total_sq_norms(grads)
    assert (watch.most, watch.storages()) == ((1, 0) if launch and freed else (5, 5))


def test_formed_is_only_for_single_plain_factored_uses(monkeypatch):
    """Ghost choices, tied (two-use) parameters, lazy convolution uses, float64 factors and the CPU
    keep their paths."""
    rep = _reps(torch.float32)[0]
    assert not formed.formable(rep)  # a CPU
    monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})
    assert formed.formable(rep)
    assert not formed.formable(R.Factored(rep.left.double(), rep.right.double(), rep.shape))
    assert not formed.formable(R.LazyFactored(rep.left, lambda: rep.right, rep.right.to("meta"), rep.shape))
    grouped = R.Factored(rep.left.view(B, 2, 3, 20), rep.right.view(B, 2, 3, 12), rep.shape)
    assert not formed.formable(grouped)
    tied, ghost = ParamGrad([rep, rep], ghost=False, freed=True), ParamGrad([rep], ghost=True, freed=True)
    param_grad.total_sq_norms([tied, ghost])
    assert isinstance(tied.reps[0], R.Dense) and ghost.reps == [rep]


@pytest.mark.parametrize("times", [(3.0, 1.0, 2.0), (3.0, 1.0, 4.0), (3.0, 2.0, 1.0), (1.0, 2.0, 0.5)])
def test_the_timed_planner_frees_only_what_it_would_take_the_ghost_norm_for(times, monkeypatch):
    """(ghost, held, freed) milliseconds per use: held while the budget lasts (two of three uses fit)
    where holding beats the ghost norm, as before; a use the plan would take the ghost norm for is
    formed and freed where that is faster and its float32 tensor fits the budget (its clipped sum
    is the ghost path's, so a plan never trades a held use for it); never with a budget of 0 (the
    ghost norm everywhere) and never on a CPU (no freed path to time)."""
    reps = _reps(torch.float32, seed=7)[:3]
    inst = cost.use_cost("x", 0, reps[0]).instantiate_bytes
    by_param = {str(i): [r] for i, r in enumerate(reps)}
    monkeypatch.setattr(cost, "measure_paths", lambda rep, stack=1: times[:2])
    monkeypatch.setattr(cost, "measure_freed", lambda rep, stack=1: times[2])
    monkeypatch.setattr(cost, "rep_device", lambda rep: torch.device("cuda"))
    monkeypatch.setattr(cost, "TIMING_ROOM", 0)  # timed whatever the budget
    paths = lambda plan: ["ghost" if c.ghost else "freed" if c.freed else "held" for cs in plan.values() for c in cs]  # noqa: E731
    held = ["held", "held", "ghost"] if times[1] < times[0] else ["ghost"] * 3
    assert paths(cost.plan_uses(by_param, budget=2.5 * inst, autotune=True)) == held
    monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})
    plan = cost.plan_uses(by_param, budget=2.5 * inst, autotune=True)
    freed = times[2] < times[0]
    assert paths(plan) == [p if p != "ghost" or not freed else "freed" for p in held]
    assert all(
        c.freed_ms == times[2] and ("formed for its norm" in c.why) == c.freed for cs in plan.values() for c in cs
    )
    assert paths(cost.plan_uses(by_param, budget=0, autotune=True)) == ["ghost"] * 3
    assert (
        paths(cost.plan_uses(by_param, budget=0.5 * inst, autotune=True)) == ["ghost"] * 3
    )  # the formed tensor does not fit


def test_the_byte_counts_are_of_what_is_formed(monkeypatch):
    """Half factors form float32 per-sample gradients and Grams: counted at 4 bytes an entry."""
    rep = _reps(torch.float32)[0]
    wide, narrow = (
        cost.use_cost("x", 0, rep),
        cost.use_cost("x", 0, R.Factored(rep.left.bfloat16(), rep.right.bfloat16(), rep.shape)),
    )
    assert (narrow.instantiate_bytes, narrow.ghost_bytes, narrow.freed_bytes) == (
        wide.instantiate_bytes,
        wide.ghost_bytes,
        wide.freed_bytes,
    )
    assert wide.freed_bytes == B * 20 * 12 * 4


@pytest.mark.parametrize("name", ["gpt2", "vit-tiny-patch16"])
def test_a_zoo_model_with_formed_uses_is_exact(name, monkeypatch):
    """End to end: a model whose timed plan forms its linear layers for their norms and frees them
    (the planner told freed is fastest) gives per-sample norms (total and per parameter) and a
    clipped sum that match per-sample backward passes."""
    model, inputs, loss_fn = zoo_model_and_inputs(name)  # in float32: formed uses are of float32 or half factors
    model, inputs = model.float(), {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}
    monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})
    monkeypatch.setattr(cost, "autotunes", lambda device: True)
    monkeypatch.setattr(cost, "measure_paths", lambda rep, stack=1: (2.0, 3.0))  # the ghost norm before holding
    monkeypatch.setattr(cost, "measure_freed", lambda rep, stack=1: 1.0)
    firsts: list = []
    real = formed.first_passes
    monkeypatch.setattr(formed, "first_passes", lambda reps: firsts.extend(reps) or real(reps))
    hooks = check_against_brute_force(model, inputs, loss_fn, "auto", tol=2e-4)  # the bound: ~3e-5 of a norm
    freed = [c for c in hooks.plan() if c["freed"]]
    assert len(firsts) >= 4 and len(freed) == len(firsts)
    firsts.clear()  # the per-parameter norms first (as the engine's self-check asks): the step's own paths
    again = attach_norm_hooks(model, mode="auto")
    try:
        again.backward(loss_fn(model, **inputs))
        per_param = again.per_param_sq_norms()
        assert len(firsts) == len(freed)
        torch.testing.assert_close(sum(per_param.values()), again.per_sample_norms().square(), rtol=1e-5, atol=0)
    finally:
        again.detach()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bf16 tensor cores)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_formed_uses_on_cuda_give_exact_norms_and_sums(dtype):
    """On a GPU's own kernels: every formed norm never below the float64 brute force and within 0.1%,
    every sum within float32 rounding of Σ_i s_i g_i."""
    reps = [R.Factored(r.left.cuda(), r.right.cuda(), r.shape) for r in _reps(dtype, seed=8)]
    scale = half.round_toward_zero(torch.rand(B, generator=torch.Generator().manual_seed(9)) + 0.1, torch.bfloat16)
    grads = {str(i): ParamGrad([r], ghost=False, freed=True) for i, r in enumerate(reps)}
    norms = param_grad.total_sq_norms(list(grads.values()))
    sums = param_grad.clipped_sums(grads, scale.cuda(), None)
    for i, (rep, norm) in enumerate(zip(reps, norms)):
        cpu = R.Factored(rep.left.cpu(), rep.right.cpu(), rep.shape)
        exact = _exact(cpu)
        assert grads[str(i)].reps == [rep]
        assert (norm.cpu().double() >= exact).all() and (norm.cpu().double() <= exact * 1.001).all()
        want = torch.einsum("b,brc->rc", scale.double(), grad64(cpu))
        assert (sums[str(i)].cpu().double() - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bf16 tensor cores)")
@pytest.mark.parametrize("assumed", [1, 4], ids=["round-to-nearest (the ghost guard's)", "4u (formed's)"])
def test_tensor_core_products_err_within_the_unit_roundoff_assumed_cuda(assumed):
    """A bf16 product on tensor cores (float32 output) of 1 and K - 1 terms just under one float32
    ulp of 1: round-to-nearest keeps each (error ≤ half an ulp a term), truncation drops each (one
    ulp a term, twice the bound). |computed - exact| must stay within γ_K(assumed · u) · Σ|terms|:
    the bound :mod:`dpzoo.grad_norms.formed` takes (4u) and the one :mod:`.rounding` takes for the
    ghost norm's Grams (u). A failure of the second says the ghost guard's bound needs 4u on tensor cores."""
    from dpzoo.grad_norms.rounding import gamma, unit_roundoff

    worst = 0.0
    for k in (64, 256, 1024, 4096):
        a = torch.full((1, k), 2.0**-23 * (1 - 2.0**-7), dtype=torch.float64)
        a[0, 0] = 1
        for order in (a, a.flip(1)):
            left, right = order.to(torch.bfloat16).cuda(), torch.ones(k, 1, dtype=torch.bfloat16, device="cuda")
            got = half.product(left, right).double().item()
            exact = order.sum().item()
            bound = gamma(k, assumed * unit_roundoff(torch.float32)) * order.abs().sum().item()
            worst = max(worst, abs(got - exact) / bound)
    assert worst <= 1, f"tensor-core error {worst:.2f} of the bound with {assumed}u"
