"""The per-layer planner (dpzoo.grad_norms.cost): its cost model, its choices under a memory budget,
the plan it shows, and that every choice it makes stays exact against brute force."""

from __future__ import annotations

import pytest
import torch
from grad_reference import assert_close, reference
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpzoo
from dpzoo.errors import InvalidArgumentError, PrivacyUsageError
from dpzoo.grad_norms import attach_norm_hooks
from dpzoo.grad_norms import reps as R
from dpzoo.grad_norms.cost import TRAFFIC, measure_paths, plan_uses, use_cost


def _factored(b, t, p, d, g=1):
    return R.Factored(torch.randn(b, g, t, p), torch.randn(b, g, t, d), (g * d, p) if g == 1 else (g, d, p))


def test_cost_model_counts_both_paths():
    b, t, p, d = 16, 128, 256, 256
    c = use_cost("w", 0, _factored(b, t, p, d))
    assert c.ghost_flops == 2 * b * t * t * (p + d) + b * t * t + 2 * b * t * p * d
    assert c.instantiate_flops == 2 * b * t * p * d + (2 + TRAFFIC) * b * p * d
    assert c.instantiate_bytes == b * p * d * 4 and c.ghost_bytes == b * t * t * 4
    e = use_cost("emb", 0, R.OneHot(torch.zeros(b, t, dtype=torch.long), torch.randn(b, t, d), 1000))
    assert e.kind == "embedding" and e.instantiate_bytes == b * 1000 * d * 4


def test_sequences_instantiate_and_single_positions_take_the_ghost_norm():
    """GPT-2-like 256-wide layer at T = 128 (the BK space rule says ghost: 2T² < p·d) is
    instantiated, being faster, when it fits; at T = 1 the ghost norm is faster."""
    seq, single = _factored(16, 128, 256, 256), _factored(16, 1, 256, 256)
    assert R.prefers_ghost(seq)  # the paper's space rule
    plan = plan_uses({"seq": [seq], "single": [single]}, budget=2**30)
    assert [c.ghost for c in plan["seq"]] == [False] and "faster" in plan["seq"][0].why
    assert [c.ghost for c in plan["single"]] == [True]
    assert [c.ghost for c in plan_uses({"seq": [seq]}, budget=0)["seq"]] == [True]


def test_one_budget_is_shared_by_time_saved_per_byte():
    small, big = _factored(4, 64, 32, 32), _factored(4, 64, 64, 64)
    cs, cb = use_cost("s", 0, small), use_cost("b", 0, big)
    assert cs.instantiate_flops < cs.ghost_flops and cb.instantiate_flops < cb.ghost_flops
    per_byte = {n: (c.ghost_flops - c.instantiate_flops) / c.instantiate_bytes for n, c in (("s", cs), ("b", cb))}
    first = max(per_byte, key=per_byte.get)
    budget = max(cs.instantiate_bytes, cb.instantiate_bytes)  # room for one, not both
    plan = plan_uses({"s": [small], "b": [big]}, budget=budget)
    instantiated = [n for n, rows in plan.items() if not rows[0].ghost]
    assert instantiated == [first]
    assert sum(rows[0].instantiate_bytes for n, rows in plan.items() if not rows[0].ghost) <= budget
    plan = plan_uses({"s": [small], "b": [big]}, budget=cs.instantiate_bytes + cb.instantiate_bytes)
    assert all(not rows[0].ghost for rows in plan.values())


class _TiedLM(nn.Module):
    """Embedding tied to the output projection, a sequence Linear and a per-sample Linear."""

    def __init__(self, vocab=40, d=12):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.emb.weight
        self.pooled = nn.Linear(d, 3)

    def forward(self, ids):
        h = torch.tanh(self.mix(self.emb(ids)))
        return self.out(h), self.pooled(h.mean(1))


def _loss(model, ids, y):
    logits, pooled = model(ids)
    lm = nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten(), reduction="sum")
    return lm + nn.functional.cross_entropy(pooled, y, reduction="sum")


def _exact_plan(**hook_kwargs) -> list[dict]:
    """The plan of a tied LM's hooks built with ``hook_kwargs``, after checking its per-sample norms
    and a weighted clipped sum against a loop of per-sample backward passes."""
    torch.manual_seed(0)
    model = _TiedLM().double()
    ids, y = torch.randint(0, 40, (5, 9)), torch.randint(0, 3, (5,))
    scale = torch.rand(5, dtype=torch.float64) + 0.1
    total, _, clipped = reference(model, _loss, {"ids": ids, "y": y}, 5, scale)
    with attach_norm_hooks(model, **hook_kwargs) as hooks:
        hooks.backward(_loss(model, ids, y))
        assert_close(hooks.per_sample_norms(), total, 1e-9, "norms")
        got = hooks.clipped_sum(scale)
        for n in clipped:
            assert_close(got[n], clipped[n], 1e-9, n)
        return hooks.plan()


@pytest.mark.parametrize("budget", [0, 5_000, None, 1e12])
def test_every_plan_is_exact_against_brute_force(budget):
    plan = _exact_plan(memory_budget=budget)
    choices = {(r["param"], r["use"]): r["choice"] for r in plan}
    assert set(choices) >= {("emb.weight", 0), ("emb.weight", 1), ("mix.weight", 0), ("pooled.weight", 0)}
    inst = sum(r["instantiate_mb"] for r in plan if r["choice"] == "instantiate") * 2**20
    if budget is not None:
        assert inst <= budget
    if budget == 0:
        assert all(r["choice"] in ("ghost", "dense") for r in plan)
    if budget == 1e12:  # no memory constraint: each use takes its cheaper path
        for r in plan:
            if r["kind"] != "dense":
                cheaper = "instantiate" if r["instantiate_gflop"] < r["ghost_gflop"] else "ghost"
                assert r["choice"] == cheaper, r
        assert choices[("pooled.weight", 0)] == "ghost"  # T = 1


def test_plan_through_the_engine_and_bad_budgets():
    torch.manual_seed(0)
    model = _TiedLM()
    ds = TensorDataset(torch.randint(0, 40, (20, 9)), torch.randint(0, 3, (20,)))
    engine = dpzoo.PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(ds, batch_size=5),
        noise_multiplier=1.0,
        memory_budget=0,
    )
    with pytest.raises(PrivacyUsageError, match="run a forward and a backward"):
        engine.plan()
    for ids, y in loader:
        if len(y):
            logits, pooled = model(ids)
            nn.functional.cross_entropy(pooled, y).backward()  # the LM head is unused: zeros
        opt.step()
        opt.zero_grad()
    plan = engine.plan()  # the last step assembled
    assert plan and all(r["choice"] in ("ghost", "dense") for r in plan)
    assert {"param", "use", "choice", "why", "ghost_gflop", "instantiate_gflop", "ghost_mb", "instantiate_mb"} <= set(
        plan[0]
    )
    for bad in (-1, "1GB", True):
        with pytest.raises(InvalidArgumentError, match="memory_budget"):
            attach_norm_hooks(nn.Linear(2, 2), memory_budget=bad)


def test_autotune_times_both_paths_once_per_shape_and_keeps_the_faster():
    plan = _exact_plan(memory_budget=1e12, autotune=True)
    linear = [r for r in plan if r["kind"] == "linear"]
    assert linear and all(r["ghost_ms"] > 0 and r["instantiate_ms"] > 0 for r in linear)
    for r in linear:  # the budget is no constraint here: the measured faster path is taken
        faster = "ghost" if r["ghost_ms"] <= r["instantiate_ms"] else "instantiate"
        assert r["choice"] == faster, r
    rep = _factored(4, 16, 8, 8)
    first = measure_paths(rep)
    bigger = R.Factored(torch.cat([rep.left] * 2), torch.cat([rep.right] * 2), rep.shape)
    assert measure_paths(bigger) == (2 * first[0], 2 * first[1])  # measured once, scaled by the batch


def test_the_model_orders_the_measured_cpu_layers_as_measured():
    """TRAFFIC's calibration (dpzoo/grad_norms/cost.py): every layer shape timed on CPU by
    benchmarks/planner_cpu.py (benchmarks/results/planner_cpu) whose two paths differ by more than
    0.1 ms gets the faster one from the model: GPT-2 4x256's layers and ResNet-18@32's first stages
    instantiated, its later stages by ghost norm."""
    import json
    from pathlib import Path

    measured = json.loads((Path(__file__).parents[1] / "benchmarks/results/planner_cpu/planner_cpu.json").read_text())
    checked = 0
    for u in measured["uses"]:
        if abs(u["ghost_ms"] - u["instantiate_ms"]) <= 0.1:
            continue
        plan = plan_uses({"w": [_factored(u["B"], u["T"], u["p"], u["d"])]}, budget=2**40, autotune=False)
        assert plan["w"][0].ghost is (u["ghost_ms"] < u["instantiate_ms"]), u["use"]
        checked += 1
    assert checked >= 8


def test_autotune_none_times_on_cuda_only_and_not_under_deterministic_algorithms():
    from dpzoo.grad_norms.cost import autotunes

    assert not autotunes(torch.device("cpu"))
    assert autotunes(torch.device("cuda"))
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert not autotunes(torch.device("cuda"))
    finally:
        torch.use_deterministic_algorithms(before)


def test_autotune_none_plans_by_the_model_on_cpu_and_by_the_timings_on_cuda(monkeypatch):
    from dpzoo.grad_norms import cost

    seq, single = _factored(16, 128, 256, 256), _factored(16, 1, 256, 256)
    timed = []

    def fake_times(rep, stack=1):  # the opposite of the model's order, so a timed plan is told apart
        timed.append(rep)
        return (1.0, 2.0) if rep is seq else (2.0, 1.0)

    monkeypatch.setattr(cost, "measure_paths", fake_times)
    on_cpu = plan_uses({"seq": [seq], "single": [single]}, budget=2**30)
    assert not timed and [on_cpu["seq"][0].ghost, on_cpu["single"][0].ghost] == [False, True]
    monkeypatch.setattr(cost, "rep_device", lambda rep: torch.device("cuda"))
    on_cuda = plan_uses({"seq": [seq], "single": [single]}, budget=2**30)
    assert len(timed) == 2 and [on_cuda["seq"][0].ghost, on_cuda["single"][0].ghost] == [True, False]
    assert on_cuda["seq"][0].ghost_ms == 1.0 and on_cuda["single"][0].instantiate_ms == 1.0
    assert not plan_uses({"seq": [seq]}, budget=2**30, autotune=False)["seq"][0].ghost  # False: never timed
    assert len(timed) == 2


def test_the_timed_ghost_path_runs_the_float_guard_as_a_step_does(monkeypatch):
    from dpzoo.grad_norms import cost, param_grad

    calls = []
    real = param_grad.checked_and_bounds
    monkeypatch.setattr(param_grad, "checked_and_bounds", lambda items: calls.append(1) or real(items))
    monkeypatch.setattr(cost, "MEASURED", {})
    ghost_ms, inst_ms = measure_paths(_factored(3, 7, 5, 6))
    assert calls and ghost_ms > 0 and inst_ms > 0  # the guard ran in the ghost path's timing


@pytest.mark.parametrize("bad", ["yes", 1, 0.5])
def test_a_bad_autotune_is_refused_before_anything_is_set_up(bad):
    with pytest.raises(InvalidArgumentError, match="autotune"):
        attach_norm_hooks(nn.Linear(2, 2), autotune=bad)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(8, 3), torch.randint(0, 2, (8,))), batch_size=4)
    engine = dpzoo.PrivacyEngine()
    with pytest.raises(InvalidArgumentError, match="autotune"):
        engine.make_private(module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0,
                            max_grad_norm=1.0, autotune=bad)  # fmt: skip
    assert engine.module is None and dpzoo.grad_norms.attached_norm_hooks(model) is None


def test_a_use_too_large_to_time_safely_keeps_the_models_choice(monkeypatch):
    """Timing runs both paths: a use whose Grams (or per-sample gradients) would not fit the budget
    TIMING_ROOM times over is not timed (ResNet-50's stem at 224² ran a GPU out of memory)."""
    from dpzoo.grad_norms import cost

    wide, small = _factored(4, 64, 8, 8), _factored(4, 2, 8, 8)
    timed = []
    monkeypatch.setattr(cost, "MEASURED", {})
    monkeypatch.setattr(cost, "measure_paths", lambda rep, stack=1: timed.append(rep) or (1.0, 2.0))
    c = use_cost("wide", 0, wide)
    budget = cost.TIMING_ROOM * max(c.ghost_bytes, c.instantiate_bytes)
    plan_uses({"wide": [wide], "small": [small]}, budget=budget - 1, autotune=True)
    assert timed == [small]
    plan = plan_uses({"wide": [wide]}, budget=budget, autotune=True)
    assert timed == [small, wide] and plan["wide"][0].ghost_ms == 1.0 and plan["wide"][0].timed
    head = _factored(4, 1, 64, 64)  # one position: instantiation (B·p·d) is the larger path
    c = use_cost("head", 0, head)
    assert c.instantiate_bytes > c.ghost_bytes
    plan_uses({"head": [head]}, budget=cost.TIMING_ROOM * c.instantiate_bytes - 1, autotune=True)
    assert timed == [small, wide]
    plan_uses({"head": [head]}, budget=cost.TIMING_ROOM * c.instantiate_bytes, autotune=True)
    assert timed == [small, wide, head]


def test_a_shape_timed_once_keeps_its_timing_when_free_memory_drops(monkeypatch):
    """The room check guards a new timing; a shape already measured is not re-run, so a later step
    with less free memory keeps the timed plan instead of falling back to the model."""
    from dpzoo.grad_norms import cost

    monkeypatch.setattr(cost, "MEASURED", {})
    wide = _factored(4, 64, 8, 8)
    c = use_cost("wide", 0, wide)
    budget = cost.TIMING_ROOM * max(c.ghost_bytes, c.instantiate_bytes)
    first = plan_uses({"wide": [wide]}, budget=budget, autotune=True)["wide"][0]
    assert first.timed and len(cost.MEASURED) == 1
    runs = []
    monkeypatch.setattr(cost, "ParamGrad", lambda *a: runs.append(a))  # a re-timing would call it
    later = plan_uses({"wide": [_factored(4, 64, 8, 8)]}, budget=budget - 1, autotune=True)["wide"][0]
    assert later.timed and runs == []
    assert (later.ghost_ms, later.instantiate_ms, later.ghost) == (first.ghost_ms, first.instantiate_ms, first.ghost)
    other = _factored(4, 64, 8, 16)  # a new shape still needs the room
    assert not plan_uses({"o": [other]}, budget=budget - 1, autotune=True)["o"][0].timed


def test_a_device_out_of_memory_while_timing_leaves_the_use_to_the_model(monkeypatch):
    from dpzoo.grad_norms import cost

    def no_room(rep, stack=1):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(cost, "measure_paths", no_room)
    seq = _factored(16, 128, 256, 256)
    plan = plan_uses({"seq": [seq]}, budget=2**30, autotune=True)
    assert not plan["seq"][0].timed and plan["seq"][0].ghost_ms is None
    assert plan["seq"][0].ghost == plan_uses({"seq": [seq]}, budget=2**30, autotune=False)["seq"][0].ghost


def test_untimed_uses_are_ranked_in_the_timed_uses_milliseconds(monkeypatch):
    """An embedding is never timed: its multiply-adds are converted at the timed uses' rate, so
    the budget does not compare milliseconds with multiply-adds."""
    from dpzoo.grad_norms import cost

    rate = 1e-9  # ms per multiply-add, the same for both paths of the timed use
    monkeypatch.setattr(cost, "measure_paths", lambda rep, stack=1: (rate * use_cost("x", 0, rep).ghost_flops,
                                                            rate * use_cost("x", 0, rep).instantiate_flops))  # fmt: skip
    seq = _factored(4, 16, 8, 8)
    emb = R.OneHot(torch.zeros(4, 16, dtype=torch.long), torch.randn(4, 16, 8), 30)
    plan = plan_uses({"seq": [seq], "emb": [emb]}, budget=2**30, autotune=True)
    e = plan["emb"][0]
    assert plan["seq"][0].timed and not e.timed
    assert e.ghost_ms == pytest.approx(e.ghost_flops * rate) and e.instantiate_ms == pytest.approx(
        e.instantiate_flops * rate
    )


def test_the_paths_are_timed_on_random_factors_of_the_shapes_never_on_the_batch(monkeypatch):
    """The float guard's rechecks take data-dependent time: a plan timed on the batch would depend
    on its values. The timed representations have the use's shapes and dtype, not its storage."""
    from dpzoo.grad_norms import cost

    seen = []
    real = cost.ParamGrad
    ghosts = []
    monkeypatch.setattr(
        cost,
        "ParamGrad",
        lambda reps, ghost, freed=False: seen.append(reps[0]) or ghosts.append(ghost) or real(reps, ghost, freed=freed),
    )
    monkeypatch.setattr(cost, "MEASURED", {})
    rep = _factored(3, 5, 4, 6)
    rep.left[0] = float("nan")  # a value the timing must never see
    measure_paths(rep)
    assert seen and all(r is not rep for r in seen)
    assert {g for g in ghosts} == {True, False}  # both paths were timed
    for r in seen:
        assert r.left.shape == rep.left.shape and r.right.shape == rep.right.shape and r.shape == rep.shape
        assert r.left.dtype == rep.left.dtype and r.left.data_ptr() != rep.left.data_ptr()
        assert torch.isfinite(r.left).all() and r.right.data_ptr() != rep.right.data_ptr()


def test_timing_draws_nothing_from_the_global_random_streams(monkeypatch):
    """Dropout masks and everything else the user seeds must not shift because a plan was timed."""
    from dpzoo.grad_norms import cost

    monkeypatch.setattr(cost, "MEASURED", {})
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    measure_paths(R.Factored(torch.ones(2, 1, 3, 4), torch.ones(2, 1, 3, 5), (5, 4)))
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("autotune", [None, True, False])
def test_the_engine_hands_its_autotune_to_the_planner(monkeypatch, autotune):
    from dpzoo.grad_norms import assembly

    got = []
    real = assembly.plan_uses
    monkeypatch.setattr(assembly, "plan_uses", lambda by, budget, tune: got.append(tune) or real(by, budget, tune))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(16, 3), torch.randint(0, 2, (16,))), batch_size=8)
    model, opt, loader = dpzoo.PrivacyEngine().make_private(
        module=model,
        optimizer=opt,
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        autotune=autotune,
        noise_seed=0,
        sample_seed=0,
    )
    x, y = next(iter(loader))
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert got and all(t is autotune for t in got)


def test_probe_factors_share_a_component_across_positions_so_the_guard_does_not_recheck(monkeypatch):
    """Random rows independent across positions make the float guard recheck every sample in
    float64 from T = 512 on (ordinary activations rarely do): the timing would charge the ghost
    path for work a step seldom does."""
    from dpzoo.grad_norms import cost, float_guard

    rechecked = []
    real = float_guard.sq_norm64
    monkeypatch.setattr(float_guard, "sq_norm64", lambda reps, rows: rechecked.append(len(rows)) or real(reps, rows))
    monkeypatch.setattr(cost, "MEASURED", {})
    measure_paths(_factored(3, 512, 16, 16))
    assert rechecked == []
    independent = _factored(3, 512, 16, 16)
    param_grad_of = cost.ParamGrad([independent], True)
    param_grad_of.sq_norm()
    assert rechecked  # the same shapes with rows independent across positions do recheck
