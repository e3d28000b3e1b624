"""On a GPU, the factored uses of one shape on the ghost path are normed, guarded and summed as one
stack along the batch (issue 30: GPT-2's 12 blocks share 4 shapes, and each use launched ~110
operators). Every sample's norm, bound and clipped sum must be what it is alone: against float64
brute force, against the one-use-at-a-time path, with adversarial rows in one member of a stack,
and end to end through a zoo model. The GPU paths run here on the CPU by adding "cpu" to
:data:`dpzoo.grad_norms.half.LAUNCH_DEVICES`.
"""

from __future__ import annotations

import pytest
import torch
from grad_reference import check_against_brute_force, count_host_reads, grad64, random_factored, zoo_model_and_inputs
from torch.utils._python_dispatch import TorchDispatchMode

from dpzoo.grad_norms import cost, half, param_grad
from dpzoo.grad_norms import reps as R
from dpzoo.grad_norms.param_grad import ParamGrad

B = 4
SHAPES = [(6, 20, 12)] * 5 + [(3, 9, 17)] * 3 + [(5, 7, 7)]  # (T, r, c): two stacks and a use alone


class _Ops(TorchDispatchMode):
    """Counts the operators dispatched, and how many were concatenations."""

    def __init__(self):
        super().__init__()
        self.ops, self.cats = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.cats += func is torch.ops.aten.cat.default
        return func(*args, **(kwargs or {}))


def _reps(dtype: torch.dtype, seed: int = 0) -> list[R.Factored]:
    return random_factored(SHAPES, B, dtype, seed)


def _spoil(reps: list[R.Factored], how: str) -> None:
    """Rows that make the float guard fire, in the middle member of the first stack."""
    rep = reps[2]
    if how == "cancelling":  # sample 1's positions cancel to 1e-4 of their size
        rep.left[1, 0, :] = rep.left[1, 0, 0]
        rep.right[1, 0, 1], rep.right[1, 0, 2:] = -(1 - 1e-4) * rep.right[1, 0, 0], 0
    elif how == "tiny":  # float32 Grams underflow
        rep.left[0] *= 1e-25
    elif how == "huge":  # squares overflow
        rep.right[3] *= 1e25
    elif how == "inf":
        rep.left[2, 0, 0, 0] = float("inf")


@pytest.mark.parametrize("how", ["none", "cancelling", "tiny", "huge", "inf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_ghost_norms_are_each_uses_own_and_never_below_the_exact_norm(how, dtype, monkeypatch):
    """Every member's guarded squared norm is what its use gives alone (ParamGrad.sq_norm) up to
    float32 rounding (a batched product may round otherwise at another batch size), never below the
    float64 brute force, and a quiet step reads the host once; a stack whose guard fires is guarded
    again, and its other members keep their own norms."""
    if dtype == torch.bfloat16 and how in ("tiny", "huge"):
        pytest.skip("bfloat16 shares float32's exponent range: the float32 cases cover it")
    reps = _reps(dtype)
    _spoil(reps, how)
    monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})
    alone = [ParamGrad([r], ghost=True).sq_norm() for r in reps]
    grads = [ParamGrad([r], ghost=True) for r in reps]
    reads = count_host_reads(monkeypatch)
    with _Ops() as ops:
        got = param_grad.total_sq_norms(grads)
    assert ops.cats == (4 if how == "none" else 6)  # two stacks of both factors; the one that fired made again
    assert (list(reads) == ["__bool__"]) == (how == "none"), reads
    for g, norm, one, rep in zip(grads, got, alone, reps):
        assert norm is g.sq_norm()  # cached on the parameter
        torch.testing.assert_close(norm, one, rtol=1e-5, atol=0, equal_nan=True)
        exact = grad64(rep).flatten(1).square().sum(1)
        ok = torch.isfinite(exact)
        assert (norm.double()[ok] >= exact[ok]).all()


def test_a_stack_launches_the_operators_of_one_use(monkeypatch):
    """Nine uses of one shape take the operators of about one (two copies, a split) where alone
    each took its own set: what a GPU's launches cost (each operator ~10 µs of host time)."""
    monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})
    gen = torch.Generator().manual_seed(1)
    make = lambda: R.Factored(
        torch.randn(B, 1, 8, 24, generator=gen), torch.randn(B, 1, 8, 16, generator=gen), (24, 16)
    )  # noqa: E731
    counts = {}
    for n in (1, 9):
        grads = {str(i): ParamGrad([make()], ghost=True) for i in range(n)}
        with _Ops() as ops:
            param_grad.total_sq_norms(list(grads.values()))
            param_grad.clipped_sums(grads, torch.rand(B, generator=gen), None)
        counts[n] = ops.ops
    assert counts[9] <= counts[1] + 12, counts


def test_stack_bytes_bounds_what_one_stack_copies(monkeypatch):
    """A stack holds STACK_BYTES of factors (one use's at least): a smaller bound, more stacks, the
    same norms."""
    monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})
    reps = _reps(torch.float32, seed=2)
    wide = param_grad.total_sq_norms([ParamGrad([r], ghost=True) for r in reps])
    one = (reps[0].left.numel() + reps[0].right.numel()) * 4
    assert param_grad.stack_capacity(reps[0]) == param_grad.STACK_BYTES // one
    monkeypatch.setattr(param_grad, "STACK_BYTES", 2 * one)  # the first shape's five uses: stacks of 2, 2, 1
    with _Ops() as ops:
        narrow = param_grad.total_sq_norms([ParamGrad([r], ghost=True) for r in reps])
    assert ops.cats == 2 * 2 + 2  # and the second shape's three (smaller) uses: one stack
    for a, b in zip(wide, narrow):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=0)
    monkeypatch.setattr(param_grad, "STACK_BYTES", 0)  # every use alone
    with _Ops() as ops:
        param_grad.total_sq_norms([ParamGrad([r], ghost=True) for r in reps])
    assert ops.cats == 0


@pytest.mark.parametrize("lose", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_clipped_sums_are_each_uses_own(lose, dtype, monkeypatch):
    """Σ_i s_i g_i of every member from one batched product: against the float64 brute force within
    float32 rounding and equal to the use's own sum up to it; a member whose scaled factor lost bits
    (tiny values) sends its stack's members to their own float64 sums, as alone."""
    reps = _reps(dtype, seed=3)
    if lose:
        reps[1].right[2] *= 2.0**-125 if dtype == torch.bfloat16 else 1e-39  # the narrower factor, scaled
    scale = half.round_toward_zero(torch.rand(B, generator=torch.Generator().manual_seed(4)) + 0.1, torch.bfloat16)
    monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})
    alone = {str(i): ParamGrad([r], ghost=True).clipped_sum(scale) for i, r in enumerate(reps)}
    grads = {str(i): ParamGrad([r], ghost=True) for i, r in enumerate(reps)}
    param_grad.total_sq_norms(list(grads.values()))  # as a step does before its sums
    reads = count_host_reads(monkeypatch)
    got = param_grad.clipped_sums(grads, scale, None)
    # one host read when no member lost bits; else one more for every flag, then the float64 sums' own
    assert reads == ["__bool__"] if not lose else reads[:2] == ["__bool__", "tolist"], reads
    for i, rep in enumerate(reps):
        exact = torch.einsum("b,brc->rc", scale.double(), grad64(rep))
        size = exact.abs().max()
        assert got[str(i)].shape == exact.shape and got[str(i)].dtype == torch.float32
        assert (got[str(i)].double() - exact).abs().max() <= 1e-5 * size
        assert (got[str(i)] - alone[str(i)]).abs().max() <= 1e-5 * size
        if lose and i in (0, 1, 2, 3, 4):  # the stack that lost bits: its members' own float64 sums
            torch.testing.assert_close(got[str(i)], alone[str(i)], rtol=0, atol=0)


def test_an_empty_batch_gives_every_member_its_own_empty_norm(monkeypatch):
    monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})
    grads = [
        ParamGrad([R.Factored(torch.randn(0, 1, 5, 4), torch.randn(0, 1, 5, 6), (4, 6))], ghost=True) for _ in range(3)
    ]
    norms = param_grad.total_sq_norms(grads)
    assert [tuple(n.shape) for n in norms] == [(0,)] * 3 and all(n is g.sq_norm() for n, g in zip(norms, grads))


def test_a_stack_is_only_of_single_factored_uses_of_one_group():
    from dpzoo.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="blocks > 1"):
        R.flagged_clipped_sum(R.Dense(torch.randn(4, 3)), torch.ones(4), 2)


@pytest.mark.parametrize("name", ["gpt2", "vit-tiny-patch16"])
def test_a_zoo_model_on_the_ghost_path_with_stacked_uses_is_exact(name, monkeypatch):
    """End to end: per-sample norms (total and per parameter) and a clipped sum of a model whose
    blocks share their layers' shapes, every use on the ghost path in stacks, against per-sample
    backward passes; the stacks ran (fewer Gram products than one per use)."""
    model, inputs, loss_fn = zoo_model_and_inputs(name)
    monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})
    products: list = []
    real = R.product
    monkeypatch.setattr(R, "product", lambda a, b: products.append(a.shape) or real(a, b))
    hooks = check_against_brute_force(model, inputs, loss_fn, "ghost")
    stacked = len(products)
    products.clear()
    monkeypatch.setattr(param_grad, "STACK_BYTES", 0)
    check_against_brute_force(model, inputs, loss_fn, "ghost")
    assert hooks is not None and 0 < stacked < len(products)


def test_the_timed_planner_times_the_ghost_path_of_a_stack(monkeypatch):
    """On a GPU the planner times a use's ghost path as the step runs it: stacked with the other
    single uses of its shape (per use), so a shape shared by many layers is not priced as alone."""
    asked = []
    monkeypatch.setattr(cost, "measure_paths", lambda rep, stack=1: asked.append(stack) or (1.0, 2.0))
    monkeypatch.setattr(cost, "rep_device", lambda rep: torch.device("cuda"))
    reps = _reps(torch.float32, seed=5)
    by_param = {str(i): [r] for i, r in enumerate(reps)}
    by_param["tied"] = [reps[0], reps[0]]  # two uses: not stacked
    cost.plan_uses(by_param, budget=2**30, autotune=True)
    assert sorted(asked) == [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]  # on a CPU nothing is stacked
    asked.clear()
    monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})
    cost.plan_uses(by_param, budget=2**30, autotune=True)
    assert sorted(asked) == [1, 1, 1, 3, 3, 3, 5, 5, 5, 5, 5]


def test_measure_paths_times_a_stack_per_use(monkeypatch):
    monkeypatch.setattr(cost, "MEASURED", {})
    monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})
    rep = _reps(torch.float32, seed=6)[0]
    ghost1, inst1 = cost.measure_paths(rep)
    ghost4, inst4 = cost.measure_paths(rep, 4)
    assert len(cost.MEASURED) == 2 and min(ghost1, inst1, ghost4, inst4) > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bf16 tensor cores)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacks_on_cuda_give_each_uses_own_norm_and_sum(dtype):
    """On a GPU's own kernels (tensor-core batched products for bfloat16): every member's norm never
    below the float64 brute force and within the guard's margin of it, each clipped sum within
    float32 rounding of Σ_i s_i g_i, and both what the use gives alone up to the kernels' rounding."""
    reps = [R.Factored(r.left.cuda(), r.right.cuda(), r.shape) for r in _reps(dtype, seed=7)]
    scale = half.round_toward_zero(torch.rand(B, generator=torch.Generator().manual_seed(8)) + 0.1, torch.bfloat16)
    grads = {str(i): ParamGrad([r], ghost=True) for i, r in enumerate(reps)}
    norms = param_grad.total_sq_norms(list(grads.values()))
    sums = param_grad.clipped_sums(grads, scale.cuda(), None)
    for i, (rep, norm) in enumerate(zip(reps, norms)):
        cpu = R.Factored(rep.left.cpu(), rep.right.cpu(), rep.shape)
        exact = grad64(cpu).flatten(1).square().sum(1)
        assert (norm.cpu().double() >= exact).all() and (norm.cpu().double() <= exact * 1.02).all()
        alone = ParamGrad([rep], ghost=True)
        torch.testing.assert_close(norm, alone.sq_norm(), rtol=1e-5, atol=0)
        want = torch.einsum("b,brc->rc", scale.double(), grad64(cpu))
        assert (sums[str(i)].cpu().double() - want).abs().max() <= 1e-5 * want.abs().max()
        torch.testing.assert_close(
            sums[str(i)], alone.clipped_sum(scale.cuda()), rtol=1e-5, atol=1e-5 * want.abs().max().item()
        )


def test_a_stack_that_does_not_fit_the_room_is_timed_with_fewer_uses_at_once(monkeypatch):
    """Timing holds every use of a stack at once on both paths: where the room (the budget, the
    device's free memory) holds TIMING_ROOM times two uses, five of one shape are timed two at a
    time; where it holds not even one, the use is left to the model."""
    asked = []
    monkeypatch.setattr(cost, "MEASURED", {})
    monkeypatch.setattr(cost, "measure_paths", lambda rep, stack=1: asked.append(stack) or (1.0, 2.0))
    monkeypatch.setattr(cost, "rep_device", lambda rep: torch.device("cuda"))
    monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})
    reps = _reps(torch.float32, seed=9)[:5]  # five uses of one shape
    c = cost.use_cost("x", 0, reps[0])
    factors = (reps[0].left.numel() + reps[0].right.numel()) * 4
    one = cost.TIMING_ROOM * max(c.ghost_bytes, c.instantiate_bytes, factors)
    plan = cost.plan_uses({str(i): [r] for i, r in enumerate(reps)}, budget=2 * one + 1, autotune=True)
    assert asked == [2] * 5 and all(cs[0].timed for cs in plan.values())
    asked.clear()
    plan = cost.plan_uses({str(i): [r] for i, r in enumerate(reps)}, budget=one - 1, autotune=True)
    assert asked == [] and not any(cs[0].timed for cs in plan.values())
