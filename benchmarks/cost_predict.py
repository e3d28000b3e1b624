"""A code change's predicted GPU effect, without a GPU: trace the working tree's training steps
(:mod:`cost_trace`, the same counts on any machine) and price them with the GPU model's constants
as ``cost_report.py`` last calibrated them (``benchmarks/results/cost/cost_report.json``).

    python benchmarks/cost_predict.py --config gpt2-small-t128 --precision bf16 \\
        --modes nonprivate-full dpzoo-instantiate dpzoo-bitfit --out after.json

Run it on the commits before and after a change (a clone each) and compare the JSON files: the
counts are exact, the times a model's (docs/RESULTS.md gives its error). Writes per mode the
operators, host reads, Python calls and the predicted H100/H200 step time and its ratio to the
first mode's.

``--timed-plan h200`` (or h100): dpzoo's planner chooses as it does on CUDA (``autotune``), each
use's two paths priced by the GPU model instead of timed: the trace of one path's operators
(:class:`~dpzoo.grad_norms.param_grad.ParamGrad`'s norm and clipped sum, as the planner times them)
turned into that device's milliseconds. Without it the trace plans as a CPU does (the multiply-add
model), which is not what a GPU runs since the planner times there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_modes  # noqa: E402
import cost_trace  # noqa: E402
import gpu_model  # noqa: E402
import torch  # noqa: E402

REPORT = Path(__file__).resolve().parent / "results" / "cost" / "cost_report.json"


def priced_plan(device: gpu_model.Device):
    """A ``prepare`` for :func:`cost_trace.trace_step`: the engine's planner times its uses, each
    path priced on ``device`` by the model (a sub-trace of the path's operators and Python calls)."""
    from dpzoo.grad_norms import cost

    priced: dict[tuple, tuple[float, ...]] = {}  # per sample, by shape without the batch (as timing is)

    def prepare(run, tracer) -> None:
        def per_sample(rep, stack: int) -> tuple[float, ...]:
            key = (tuple(rep.left.shape[1:]), tuple(rep.right.shape[1:]), rep.right.dtype, stack)
            if key not in priced:  # priced on the warm-up steps: the traced step's Python calls stay counted
                priced[key] = tuple(ms / rep.batch_size for ms in _price_paths(rep, tracer, device, stack))
            return priced[key]

        def price(rep, stack: int = 1) -> tuple[float, float]:
            ghost, held, _ = per_sample(rep, stack)
            return ghost * rep.batch_size, held * rep.batch_size

        cost.measure_paths = price  # restored by predict()
        cost.measure_freed = lambda rep, stack=1: per_sample(rep, stack)[2] * rep.batch_size
        if run.engine is not None:
            run.engine.hooks.autotune = True

    return prepare


def _price_paths(rep, tracer, device: gpu_model.Device, stack: int = 1) -> list[float]:
    """The model's milliseconds on ``device`` of ``rep``'s ghost path, its instantiation path held,
    then formed for the norm and freed, per use of ``stack`` uses of its shape at once (as
    :func:`dpzoo.grad_norms.cost.measure_paths` and ``measure_freed`` time them)."""
    from dpzoo.grad_norms.cost import run_paths

    times = []
    for ghost, freed in ((True, False), (False, False), (False, True)):
        saved, recording = tracer.trace, tracer.recording
        tracer.trace, tracer.recording = cost_trace.Trace(), True
        try:
            with cost_trace.count_python_calls(tracer.trace):
                run_paths(rep, ghost, stack, torch.ones(rep.batch_size, device=rep.right.device), freed)
            path = tracer.trace
        finally:
            tracer.trace, tracer.recording = saved, recording
        times.append(gpu_model.predict(gpu_model.arrays(path), device)["ms"] / stack)
    return times


def predict(
    config: str, precision: str, modes: list[str], report: Path = REPORT, timed_plan: str | None = None
) -> dict:
    from dpzoo.grad_norms import cost

    constants = json.loads(report.read_text())["validation"]["constants"]
    devices = {k: dataclasses.replace(d, **constants) for k, d in gpu_model.DEVICES.items()}
    prepare = priced_plan(devices[timed_plan]) if timed_plan else None
    rows = {}
    for mode in modes:
        measure, freed = cost.measure_paths, cost.measure_freed
        try:
            trace = cost_trace.trace_step(config, mode, precision, prepare=prepare)
        finally:
            cost.measure_paths, cost.measure_freed = measure, freed
        counts = cost_trace.summarize(trace)
        shaped = gpu_model.arrays(trace)
        rows[mode] = {k: counts[k] for k in ("ops", "host_reads", "python_calls", "peak_mb")}
        rows[mode].update({f"{k}_ms": gpu_model.predict(shaped, d)["ms"] for k, d in devices.items()})
    base = rows[modes[0]]
    for row in rows.values():
        row.update({f"{k}_ratio": row[f"{k}_ms"] / base[f"{k}_ms"] for k in devices})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, choices=list(bench_modes.ALL_CONFIGS))
    parser.add_argument("--precision", default="bf16", choices=bench_modes.PRECISIONS)
    parser.add_argument("--modes", nargs="+", required=True, help="the first is the ratios' baseline")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timed-plan", choices=list(gpu_model.DEVICES), default=None,
                        help="plan as dpzoo does on that GPU (paths priced by the model), not as on a CPU")  # fmt: skip
    parser.add_argument("--memory-budget", type=float, default=None,
                        help="the engine's memory_budget in bytes (default: cost_trace's, half of an 80 GB GPU)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.memory_budget is not None:
        cost_trace.ENGINE["memory_budget"] = args.memory_budget
    warnings.filterwarnings("ignore")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "command": "python benchmarks/cost_predict.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "git_commit": commit,
        "constants_from": str(REPORT.relative_to(REPORT.parents[2])),
        "config": args.config,
        "precision": args.precision,
        "memory_budget": cost_trace.ENGINE["memory_budget"],
        "plan": f"timed, priced on the {args.timed_plan}"
        if args.timed_plan
        else "the multiply-add model (as on a CPU)",
        "modes": predict(args.config, args.precision, args.modes, timed_plan=args.timed_plan),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["modes"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
