"""benchmarks/cost_trace.py, gpu_model.py and cost_report.py: exact counts of a step without
computing it, the roofline model, the report."""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from dpzoo.grad_norms import half

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the scripts import their helper modules by their bare names

import bench_modes  # noqa: E402
import cost_report  # noqa: E402
import cost_trace  # noqa: E402
import gpu_model  # noqa: E402


def _traced(fn):
    tracer = cost_trace.ShapeTrace()
    tracer.recording = True
    with tracer:
        out = fn()
    return tracer.trace, out


def _kernels(trace, name):
    return [op for op in trace.ops if op.kernel and op.name.startswith(name)]


def test_linear_forward_and_backward_flops_and_bytes_are_the_hand_computed_ones():
    B, din, dout = 8, 24, 40
    layer = nn.Linear(din, dout)

    def step():
        x = torch.randn(B, din)
        layer(x).sum().backward()

    trace, _ = _traced(step)
    (addmm,) = _kernels(trace, "aten.addmm")
    assert addmm.flops == 2 * B * din * dout
    assert addmm.read == 4 * (dout + B * din + din * dout)  # bias, input, weight
    assert addmm.written == 4 * B * dout
    mms = _kernels(trace, "aten.mm")
    assert sorted(op.flops for op in mms) == [2 * B * din * dout]  # the weight gradient (no input gradient)
    assert sum(op.flops for op in trace.ops if op.unit == "fp32") == 4 * B * din * dout
    assert all(op.unit == "memory" for op in trace.ops if not op.name.startswith(("aten.addmm", "aten.mm")))


def test_conv2d_flops_are_the_hand_computed_ones_and_half_products_run_on_tensor_cores():
    B, cin, cout, k, hw = 2, 3, 5, 3, 10
    conv = nn.Conv2d(cin, cout, k, padding=1)
    trace, out = _traced(lambda: conv(torch.randn(B, cin, hw, hw)))
    assert out.shape == (B, cout, hw, hw) and isinstance(out, torch.Tensor)
    (op,) = _kernels(trace, "aten.convolution")
    assert op.flops == 2 * B * cout * hw * hw * cin * k * k
    assert op.written == 4 * B * cout * hw * hw and op.unit == "tc_tf32"  # cuDNN's default for float32
    trace, _ = _traced(lambda: torch.randn(4, 8, 16).bfloat16() @ torch.randn(4, 16, 2).bfloat16())
    assert _kernels(trace, "aten.bmm")[0].unit == "tc_half"
    trace, _ = _traced(lambda: torch.randn(4, 8, 16).double() @ torch.randn(4, 16, 2).double())
    assert _kernels(trace, "aten.bmm")[0].unit == "fp64"


@pytest.mark.parametrize("groups", [1, 4])
def test_a_grouped_convolutions_weight_gradient_counts_its_groups_once(groups):
    """torch.utils.flop_counter contracts the whole input with every output channel in a grouped
    convolution's weight gradient (groups times too many FLOPs: 32x for dpzoo's per-sample route,
    the batch folded into the groups); the trace counts each group's own channels."""
    B, cin, cout, k, hw = 2, 8, 12, 3, 6
    conv = nn.Conv2d(cin, cout, k, padding=1, groups=groups)
    trace, _ = _traced(lambda: conv(torch.randn(B, cin, hw, hw, requires_grad=True)).sum().backward())
    (op,) = _kernels(trace, "aten.convolution_backward")
    per_gradient = 2 * B * cout * hw * hw * (cin // groups) * k * k  # input and weight gradients alike
    assert op.flops == 2 * per_gradient


def test_in_place_foreach_and_attention_operators_are_counted_as_a_gpu_runs_them():
    n = 1000
    a, b = torch.randn(n), torch.randn(n)
    trace, _ = _traced(lambda: torch.empty_like(a).normal_())
    (draw,) = _kernels(trace, "aten.normal_")
    assert (draw.read, draw.written) == (0, 4 * n)  # a fill does not read its destination
    trace, _ = _traced(lambda: a.add_(b))
    (add,) = _kernels(trace, "aten.add_")
    assert (add.read, add.written) == (8 * n, 4 * n)
    trace, _ = _traced(lambda: torch._foreach_add_([a, b], [b, a]))
    (step,) = _kernels(trace, "aten._foreach_add_")  # one multi-tensor kernel for the list
    assert (step.read, step.written) == (16 * n, 8 * n)
    trace, out = _traced(lambda: torch.randn(6, 4) @ torch.randn(3, 4, 5))  # a batched matmul's view
    assert out.shape == (3, 6, 5) and not _kernels(trace, "aten._unsafe_view")
    B, H, T, D = 2, 3, 16, 8
    q, k, v = (torch.randn(B, H, T, D, requires_grad=True) for _ in range(3))
    trace, _ = _traced(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v).sum().backward())
    fwd = [op for op in _kernels(trace, "aten._scaled_dot_product") if "backward" not in op.name]
    bwd = [op for op in _kernels(trace, "aten._scaled_dot_product") if "backward" in op.name]
    assert [op.flops for op in fwd] == [4 * B * H * T * T * D]  # Q·Kᵀ and P·V
    assert bwd and bwd[0].flops > fwd[0].flops and fwd[0].unit == "fp32"


def test_nothing_is_computed_and_live_memory_is_counted():
    n = 2**20  # 4 MB of float32
    tracer = cost_trace.ShapeTrace()
    tracer.recording = True
    with tracer:
        a = torch.ones(n)
        b = a * 3
        assert tracer.live_bytes() == 8 * n
        del a
        c = b + 1
    assert tracer.trace.peak_bytes == 8 * n  # a freed before c
    assert tracer.live_bytes() == 8 * n
    assert c.shape == (n,)
    assert not bool((c == 4).all())  # values were never computed (the memory is whatever was there)


def test_a_tolist_is_a_host_read_answered_as_a_passing_step():
    """``tolist`` reads memory without an operator: under the trace it is counted as a host read and
    answered False / 0 (a flag that fired on uninitialised memory priced spurious float64 sums)."""
    tracer = cost_trace.ShapeTrace()
    tracer.recording = True
    with tracer:
        flags = torch.ones(3, 2) > 0
        got = flags.tolist()
    assert got == [[False, False]] * 3 and torch.ones(2).tolist() == [1.0, 1.0]  # the real one back
    reads = [op for op in tracer.trace.ops if op.sync]
    assert [op.name for op in reads] == ["Tensor.tolist"] and not reads[0].kernel


def test_a_traced_step_runs_the_operators_of_a_real_step(monkeypatch):
    """The shape-only step launches the same operators, in the same order, as the step computed
    for real (after the same warm-up) whose host reads get the same answers (those of a step where
    no check fires: on real data a check may fire on a few rows, e.g. the zero gradient of a shifted
    LM's last position, and costs a few small kernels more), for the non-private and DP modes."""
    gpt2, resnet = bench_modes.TINY_CONFIGS["gpt2-tiny-tied"], dict(bench_modes.CONFIGS["resnet18-gn-bias@32"], batch=4)
    cases = [(gpt2, "nonprivate-full"), (gpt2, "dpzoo-bk-mixopt"), (gpt2, "dpzoo-bitfit"), (resnet, "dpzoo-bk-mixopt")]
    for config, mode in cases:
        traced = [op.name for op in cost_trace.trace_step(config, mode, "fp32", cpu_routes=True).ops]  # as run here
        run = bench_modes.make_runner(config, mode, "cpu", "fp32", engine_kwargs=cost_trace.ENGINE, foreach=True)
        for _ in range(2):
            run.step()
        names = []

        class Names(torch.utils._python_dispatch.TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                names.append(str(func))
                if func in cost_trace.HOST_READS:
                    return cost_trace.passing_answer(func, args)
                return func(*args, **(kwargs or {}))

        batch = run.next_batch()
        monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})  # as traced: a GPU's batched products
        with Names():
            run.train_step(batch)
        monkeypatch.undo()
        assert names == traced, mode


def test_counts_are_deterministic_and_the_dp_step_costs_more():
    config = bench_modes.TINY_CONFIGS["llama-tiny"]
    dp = cost_trace.trace_step(config, "dpzoo-bk-mixopt", "bf16")
    plain = cost_trace.trace_step(config, "nonprivate-full", "bf16")
    a, base = cost_trace.summarize(dp), cost_trace.summarize(plain)
    b = cost_trace.summarize(cost_trace.trace_step(config, "dpzoo-bk-mixopt", "bf16"))
    # every operator is attributed to the dpzoo function that ran it: no DP machinery in non-private training
    assert not any(op.source.startswith(("grad_norms/", "privacy/")) for op in plain.ops)
    # no tensor made from host values inside the DP step: on a GPU its copy to the device waits for
    # the queue, a host read the trace would not count (round_up made one per norm until 11-28)
    assert not [op.source for op in dp.ops if op.name == "aten.lift_fresh.default" and op.source]
    assert any(op.source.startswith("nn/") for op in plain.ops)  # dpzoo's own RMSNorm module
    top = gpu_model.by_source(dp, gpu_model.DEVICES["h100"])
    assert any(r["source"].startswith("grad_norms/") for r in top)
    assert sum(r["host_reads"] for r in gpu_model.by_source(dp, gpu_model.DEVICES["h100"], top=1000)) == a["host_reads"]
    assert a == b
    assert a["kernels"] > base["kernels"] and a["host_reads"] > base["host_reads"] == 0
    assert a["python_calls"] > base["python_calls"] > 0
    assert "tc_half" in a["gflops"] and "fp32" not in base["gflops"]  # autocast: the products in bf16


def _op(flops=0.0, nbytes=0, unit="memory", kernel=True, sync=False):
    return cost_trace.Op("x", flops, nbytes, 0, "float32", unit, kernel, sync)


def test_roofline_takes_the_slower_of_compute_and_memory_and_the_host_waits_at_reads():
    d = gpu_model.Device("test", {u: 1e12 for u in gpu_model.UNITS[1:]}, 1e12, {u: 1.0 for u in gpu_model.UNITS[1:]},
                         memory_efficiency=1.0, kernel_s=1e-6, host_op_s=1e-6, host_call_s=0.0, host_read_s=1e-3)  # fmt: skip
    compute = cost_trace.Trace([_op(flops=5e9, nbytes=1e6, unit="fp32")])
    assert gpu_model.predict(compute, d)["ms"] == pytest.approx(5.001)  # + the kernel's fixed 1 µs
    memory = cost_trace.Trace([_op(flops=5e9, nbytes=7e9, unit="fp32")])
    assert gpu_model.predict(memory, d)["ms"] == pytest.approx(7.001)
    tiny = cost_trace.Trace([_op(nbytes=1)] * 10)  # launch-bound: host 1 µs per op, kernel 1 µs
    assert gpu_model.predict(tiny, d)["ms"] == pytest.approx(0.01)
    # a host read between two 2 ms kernels: no overlap across it, plus its latency
    synced = cost_trace.Trace([_op(nbytes=2e9), _op(kernel=False, sync=True), _op(nbytes=2e9)])
    p = gpu_model.predict(synced, d)
    assert p["ms"] == pytest.approx(2.001 + 1.0 + 2.001) and p["bound"] == "device"
    calls = dataclasses_replace(d, host_call_s=1e-3)
    assert gpu_model.predict(cost_trace.Trace([_op(nbytes=1)], python_calls=4), calls)["ms"] == pytest.approx(4.001)


def dataclasses_replace(d, **kw):
    import dataclasses

    return dataclasses.replace(d, **kw)


def test_calibration_recovers_constants_that_explain_the_ratios():
    """Synthetic cells whose 'measured' ratios come from a device with grid constants: the
    calibration finds constants that reproduce every ratio, in and out of sample."""
    truth = dataclasses_replace(gpu_model.DEVICES["h100"], memory_efficiency=0.4, host_op_s=8e-6, host_call_s=1e-6)
    cells = collections.defaultdict(list)
    for i, n in enumerate((10, 200, 3000)):
        base = gpu_model.arrays(cost_trace.Trace([_op(nbytes=4e8)] * 20, python_calls=100))
        mode = gpu_model.arrays(cost_trace.Trace([_op(nbytes=4e8)] * 20 + [_op(nbytes=1e4)] * n, python_calls=100 * n))
        ratio = gpu_model.predict(mode, truth)["ms"] / gpu_model.predict(base, truth)["ms"]
        cells[f"g{i % 2}"].append((mode, base, ratio))
    fitted, held_out = gpu_model.calibrate(dict(cells), gpu_model.DEVICES["h100"])
    assert all(abs(e) < 0.05 for e in gpu_model.ratio_errors([c for v in cells.values() for c in v], fitted))
    assert set(held_out) == {"g0", "g1"} and [len(v) for v in held_out.values()] == [2, 1]
    assert all(abs(e) < 0.05 for v in held_out.values() for e in v)  # fitted on the other group alone


def test_report_writes_counts_ratios_and_predictions(tmp_path):
    argv = ["--configs", "gpt2-tiny-tied", "--precisions", "bf16", "--modes", "dpzoo-bitfit", "opacus-ghost"]
    assert cost_report.main(argv + ["--no-validate", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "cost_report.json").read_text())
    rows = data["configs"]["gpt2-tiny-tied"]["precisions"]["bf16"]
    assert set(rows) == {"nonprivate-full", "nonprivate-bias", "dpzoo-bitfit", "opacus-ghost"}
    assert rows["opacus-ghost"]["status"] == "failed" and "tied" in rows["opacus-ghost"]["reason"]
    bitfit = rows["dpzoo-bitfit"]
    assert bitfit["ratio"]["kernels"] > 1 and bitfit["ratio_to_second"]["kernels"] > bitfit["ratio"]["kernels"]
    assert set(bitfit["predicted"]) == {"h100", "h200"} and bitfit["predicted"]["h100"]["ms"] > 0
    # the H200's bandwidth is higher, its compute the same: never slower
    assert bitfit["predicted"]["h200"]["device_ms"] <= bitfit["predicted"]["h100"]["device_ms"]


def test_measured_cells_are_read_from_every_table():
    for _, _, patterns, _, _ in cost_report.TABLES:
        cells = cost_report.measured_cells(patterns)
        assert cells and all(c["measured_ratio"] > 0 and c["mode"] != "nonprivate-full" for c in cells)


def test_floor_flops_counts_what_each_mode_computes(tmp_path):
    """benchmarks/floor_flops.py: per mode the traced step's FLOPs and bytes against non-private
    training's; at T = 8 ghost norms cost little, and instantiation replaces the weight-gradient
    products, so neither may fall below the non-private step's FLOPs."""
    import floor_flops

    assert floor_flops.main(["--configs", "gpt2-tiny-tied", "--out", str(tmp_path)]) == 0
    counts = json.loads((tmp_path / "flops.json").read_text())["configs"]["gpt2-tiny-tied"]
    assert set(counts) == set(floor_flops.MODES)
    assert counts["nonprivate-full"]["gflops_ratio"] == 1.0
    for mode in ("dpzoo-bk-mixopt", "dpzoo-bk", "dpzoo-instantiate"):
        assert counts[mode]["gflops"] >= counts["nonprivate-full"]["gflops"] > 0
        assert counts[mode]["ops"] > counts["nonprivate-full"]["ops"]  # the norms are operators of their own


def test_a_timed_plan_is_priced_by_the_model_and_changes_what_is_traced():
    """cost_predict --timed-plan: the planner times (autotune) with each path priced by the GPU
    model, as a GPU's planner chooses; the traced step's Python calls stay counted, and the
    library's own timing function is restored afterwards."""
    import cost_predict

    from dpzoo.grad_norms import cost

    measure, autotuned = cost.measure_paths, []
    prepare = cost_predict.priced_plan(gpu_model.DEVICES["h200"])

    def spy(run, tracer):
        prepare(run, tracer)
        autotuned.append(run.engine.hooks.autotune)

    try:
        timed = cost_trace.summarize(cost_trace.trace_step("gpt2-tiny-tied", "dpzoo-bk-mixopt", "bf16", prepare=spy))
    finally:
        cost.measure_paths = measure
    planned = cost_trace.summarize(cost_trace.trace_step("gpt2-tiny-tied", "dpzoo-bk-mixopt", "bf16"))
    assert autotuned == [True] and timed != planned  # another plan: other operators
    assert timed["python_calls"] > planned["python_calls"] / 2 > 0
    rows = cost_predict.predict("gpt2-tiny-tied", "bf16", ["nonprivate-full", "dpzoo-bk-mixopt"], timed_plan="h200")
    assert cost.measure_paths is measure and rows["dpzoo-bk-mixopt"]["ops"] == timed["ops"]


@pytest.mark.parametrize("cpu_routes", [False, True])
def test_a_traced_step_takes_the_cpu_only_convolution_route_only_when_asked(cpu_routes):
    """The trace runs CPU tensors but stands for a GPU's step: a convolution's per-sample gradients
    by grouped convolution (dpzoo's CPU-only route) are left out unless ``cpu_routes`` (the CPU
    counts of floor_flops.py), and the setting is restored afterwards."""
    from dpzoo.grad_norms.rules import conv

    before = conv.GROUPED_MIN_POSITIONS
    cfg = dict(kind="image", name="resnet18-gn-bias", size=32, batch=4)
    trace = cost_trace.trace_step(cfg, "dpzoo-instantiate", cpu_routes=cpu_routes)
    folded = [op for op in _kernels(trace, "aten.convolution_backward") if "by_grouped_convolution" in op.source]
    assert bool(folded) is cpu_routes
    assert _kernels(trace, "aten.convolution_backward")  # the input gradients, either way
    assert conv.GROUPED_MIN_POSITIONS == before


def test_a_reduction_over_short_runs_is_priced_at_the_measured_share_of_the_bandwidth():
    """A norm whose outputs each reduce k contiguous entries records k (a reduction over an outer
    dimension, or to one value, records 0); the model reads 32-entry runs at the H200's measured
    share (dense_norm_runs.json), 2,048 and more at the whole bandwidth, the same bytes either way."""
    x = torch.randn(8, 64, 1024)
    trace, _ = _traced(lambda: [
        torch.linalg.vector_norm(x.view(8, 2048, 32), dim=-1),
        torch.linalg.vector_norm(x, dim=-1),
        x.sum(dim=(1, 2)),
        x.sum(dim=0),
        torch.linalg.vector_norm(x),
        torch.linalg.vector_norm(x.transpose(1, 2), dim=-1),
        torch.linalg.vector_norm(x.view(8, -1)[:, :2048].view(8, 64, 32), dim=-1),  # a row slice's runs
    ])  # fmt: skip
    assert [op.inner for op in trace.ops if op.kernel] == [32, 1024, 65536, 0, 0, 0, 32]
    d = dataclasses_replace(gpu_model.DEVICES["h200"], kernel_s=0.0)
    a = gpu_model.arrays(trace)
    times = gpu_model.kernel_seconds(a, d)[a.kernel]
    full = a.nbytes[a.kernel] / (d.bandwidth * d.memory_efficiency)  # its bytes at the whole bandwidth
    assert times == pytest.approx(full / [0.18, 0.95, 1, 1, 1, 1, 0.18])
    runs = cost_trace.Op("aten.linalg_vector_norm", 0, 10**9, 10**6, "float32", "memory", True, False,
                         "grad_norms/rounding.py:_runs_sq", inner=1024)  # fmt: skip
    priced = [
        gpu_model.kernel_seconds(gpu_model.arrays(cost_trace.Trace([runs]), dense_runs=k), d)[0] for k in (None, 32)
    ]
    assert priced[1] / priced[0] == pytest.approx(0.95 / 0.18)  # a table measured when the GPU took runs of 32
