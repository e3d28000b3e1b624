"""Where a training step's time goes: torch.profiler over a few steps of one or more modes of a
benchmark config, so a missed speed target can be explained from a profile rather than a guess.

For each mode (built once by ``bench_modes.make_runner``, warmed up, then profiled for ``--steps``
steps) it records:

- ``phases``: time per step of the forward (with the loss), the backward (dpzoo computes the
  per-sample norms in its backward hooks) and the optimizer step (clip, noise, update), from
  ``record_function`` ranges around each phase, on the device the config runs on;
- ``top_ops``: the operators with the most self time (device time on a GPU, CPU time on a CPU);
- ``dpzoo_lines``: self time attributed to the innermost dpzoo source line that launched it (from
  the profiler's Python stacks), which names the rule or reduction that costs the time.

Writes ``profile_<config>_<precision>.json`` and a readable ``.txt`` beside it. Not a test: timings
depend on the machine; compare modes within one file only.

    python benchmarks/profile_step.py --configs gpt2-tiny-tied --modes nonprivate-full dpzoo-bk-mixopt
    python benchmarks/profile_step.py --device cuda --configs gpt2-small-t128 resnet50-gn-bias@224 \
        --out benchmarks/results/gpu/profiles
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_modes  # noqa: E402

PHASES = ("forward", "backward", "optimizer")


def _self_time_us(evt, on_device: bool) -> float:
    if on_device:
        return float(getattr(evt, "self_device_time_total", getattr(evt, "self_cuda_time_total", 0.0)))
    return float(evt.self_cpu_time_total)


def _total_time_us(evt, on_device: bool) -> float:
    if on_device:
        return float(getattr(evt, "device_time_total", getattr(evt, "cuda_time_total", 0.0)))
    return float(evt.cpu_time_total)


def dpzoo_frame(stack) -> str | None:
    """The innermost frame of dpzoo's own code in a profiler stack ('path/file.py(line): func')."""
    for frame in stack or ():
        if frame.startswith("dpzoo/") or "/dpzoo/" in frame:  # the package, installed or from a checkout
            return "dpzoo/" + frame.rsplit("dpzoo/", 1)[1]
    return None


def profile_mode(config: str, mode: str, device: str, precision: str, warmup: int, steps: int, top: int) -> dict:
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    try:
        run = bench_modes.make_runner(config, mode, device, precision)
    except bench_modes.Unsupported as e:
        return {"mode": mode, "status": "unsupported", "reason": str(e)}
    on_device = device.startswith("cuda")

    def step() -> None:
        run.train_step(run.next_batch(), record_function)

    try:
        for _ in range(warmup):
            step()
        if on_device:
            torch.cuda.synchronize()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
        # verbose: without it the profiler records no Python stacks (pytorch/pytorch#100253)
        config = torch._C._profiler._ExperimentalConfig(verbose=True)
        with profile(activities=activities, with_stack=True, experimental_config=config) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                step()
            if on_device:
                torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - start) * 1e3 / steps
    except Exception as e:  # out of memory, or a library failing (e.g. Opacus under autocast)
        return {"mode": mode, **bench_modes.failure(e)}
    finally:
        run = None  # the model and optimizer go before the next mode is built
        if on_device:
            bench_modes.free_cuda()

    events = prof.key_averages()
    phases = {e.key: _total_time_us(e, on_device) / 1e3 / steps for e in events if e.key in PHASES}
    # every kernel's own time: on a GPU the phases' ranges are spans on the device (idle gaps
    # included, and the backward's kernels run outside its range), so they do not add up to this
    # (the phases' own device-side ranges are events on the device too: left out; they doubled the sum
    # in the first profile that wrote it, 2026-11-28)
    kernels = [e for e in events if getattr(e, "device_type", DeviceType.CPU) != DeviceType.CPU and e.key not in PHASES]
    kernel_ms = sum(_self_time_us(e, True) for e in kernels) / 1e3 / steps if on_device else None
    ops = sorted((e for e in events if e.key not in PHASES), key=lambda e: -_self_time_us(e, on_device))
    top_ops = [
        {"op": e.key, "calls_per_step": e.count / steps, "self_ms_per_step": _self_time_us(e, on_device) / 1e3 / steps}
        for e in ops[:top]
        if _self_time_us(e, on_device) > 0
    ]
    lines: dict[str, float] = defaultdict(float)
    for e in prof.key_averages(group_by_stack_n=12):
        frame = dpzoo_frame(e.stack)
        # on a GPU an operator's self time is its kernels' and each kernel is an event too: count
        # the operators only (the H200 profile of 11-28 counted every kernel twice)
        kernel = on_device and getattr(e, "device_type", DeviceType.CPU) != DeviceType.CPU
        if frame is not None and e.key not in PHASES and not kernel:
            lines[frame] += _self_time_us(e, on_device) / 1e3 / steps
    dpzoo_lines = [{"line": k, "self_ms_per_step": v} for k, v in sorted(lines.items(), key=lambda kv: -kv[1])[:top]]
    return {
        "mode": mode,
        "status": "ok",
        "time": "device (CUDA kernel) time" if on_device else "CPU time",
        "step_ms": sum(phases.values()),
        "phases_ms": phases,
        "wall_ms": wall_ms,  # under the profiler (slower than unprofiled)
        "kernel_ms": kernel_ms,  # the GPU's busy time; wall - kernel ~ time the GPU waited on the host
        "top_ops": top_ops,
        "dpzoo_lines": dpzoo_lines,
    }


def render(result: dict) -> str:
    out = [f"# {result['config']} ({result['precision']}, {result['device']})"]
    for m in result["modes"]:
        if m["status"] != "ok":
            out.append(f"\n## {m['mode']}: {m['status']}: {m.get('reason', '')}")
            continue
        ph = ", ".join(f"{k} {v:.2f}" for k, v in m["phases_ms"].items())
        out.append(f"\n## {m['mode']}: {m['step_ms']:.2f} ms/step of {m['time']} ({ph})")
        busy = f", kernels {m['kernel_ms']:.2f} ms" if m.get("kernel_ms") is not None else ""
        out.append(f"  wall {m['wall_ms']:.2f} ms/step under the profiler{busy}")
        out += [f"  {o['self_ms_per_step']:9.3f} ms  x{o['calls_per_step']:<6.0f} {o['op']}" for o in m["top_ops"]]
        if m["dpzoo_lines"]:
            out.append("  -- by dpzoo source line --")
            out += [f"  {d['self_ms_per_step']:9.3f} ms  {d['line']}" for d in m["dpzoo_lines"]]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=["gpt2-tiny-tied"], choices=sorted(bench_modes.ALL_CONFIGS))
    p.add_argument("--modes", nargs="+", default=["nonprivate-full", "dpzoo-bk-mixopt"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="fp32", choices=bench_modes.PRECISIONS)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="benchmarks/results/profiles")
    args = p.parse_args(argv)
    unknown = [m for m in args.modes if m not in bench_modes.MODES]
    if unknown:
        p.error(f"unknown mode(s) {', '.join(unknown)}: choose from {', '.join(bench_modes.MODES)}")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for config in args.configs:
        modes = bench_modes.config_modes(config, args.modes)
        result = {
            "config": config,
            "precision": args.precision,
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "torch": torch.__version__,
            "steps": args.steps,
            "modes": [
                profile_mode(config, m, args.device, args.precision, args.warmup, args.steps, args.top) for m in modes
            ],
        }
        stem = out / f"profile_{config.replace('@', '_')}_{args.precision}"
        text = render(result)
        stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
        stem.with_suffix(".txt").write_text(text)
        print(text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
