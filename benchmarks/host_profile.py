"""Where a training step's host time goes: Python's cProfile over a few steps of one mode of a
benchmark config, by function (own time and time including callees), for steps bound by the host
(a GPU waiting on Python: the 1.1B llama's DP-BiTFiT, 2026-11-28, ran ~76 ms of kernels in a 160 ms
step). ``profile_step.py`` gives the device's side (kernels by operator); this gives the host's.

Writes ``host_<config>_<mode>_<precision>.json`` (the step time with and without the profiler, the
top functions by own and by cumulative time per step) and prints the top rows. Not a test: timings
depend on the machine; cProfile slows Python-heavy code, so read the shares, not the times.

    python benchmarks/host_profile.py llama-22x64-t16 dpzoo-bitfit              # a CPU proxy
    python benchmarks/host_profile.py llama-bias-1b-t512 dpzoo-bitfit --device cuda --precision bf16
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_modes  # noqa: E402


def _timed_steps(run, steps: int) -> float:
    """Seconds per step of ``steps`` steps (device synchronised around them)."""
    import torch

    def wait() -> None:
        if run.device.startswith("cuda"):
            torch.cuda.synchronize()

    wait()
    start = time.perf_counter()
    for _ in range(steps):
        run.train_step(run.next_batch())
    wait()
    return (time.perf_counter() - start) / steps


def _rows(stats: pstats.Stats, key: int, steps: int, top: int) -> list[dict]:
    """The ``top`` functions by ``key`` (2: own time, 3: cumulative), in ms per step."""
    entries = sorted(stats.stats.items(), key=lambda kv: -kv[1][key])[:top]  # type: ignore[attr-defined]
    return [
        {
            "function": f"{Path(file).name}:{line}({name})" if file != "~" else name,
            "file": file,
            "calls_per_step": calls / steps,
            "own_ms_per_step": own * 1e3 / steps,
            "cumulative_ms_per_step": cum * 1e3 / steps,
        }
        for (file, line, name), (_, calls, own, cum, _) in entries
    ]


def host_profile(config: str, mode: str, device: str, precision: str, steps: int, top: int) -> dict:
    run = bench_modes.make_runner(config, mode, device, precision)
    for _ in range(3):  # warm-up: the first steps plan, check and compile
        run.train_step(run.next_batch())
    plain = _timed_steps(run, steps)
    profiler = cProfile.Profile()
    profiler.enable()
    profiled = _timed_steps(run, steps)
    profiler.disable()
    stats = pstats.Stats(profiler)
    return {
        "config": config,
        "mode": mode,
        "device": device,
        "precision": precision,
        "steps": steps,
        "step_ms": plain * 1e3,
        "profiled_step_ms": profiled * 1e3,
        "by_own_time": _rows(stats, 2, steps, top),
        "by_cumulative_time": _rows(stats, 3, steps, top),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", choices=list(bench_modes.ALL_CONFIGS))
    parser.add_argument("mode")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32", choices=bench_modes.PRECISIONS)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--out", default="benchmarks/results/host_profile")
    args = parser.parse_args(argv)
    result = host_profile(args.config, args.mode, args.device, args.precision, args.steps, args.top)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"host_{args.config}_{args.mode}_{args.precision}.json".replace("@", "_")
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{args.config} {args.mode}: {result['step_ms']:.1f} ms/step ({result['profiled_step_ms']:.1f} profiled)")
    for row in result["by_cumulative_time"][:25]:
        print(f"  {row['cumulative_ms_per_step']:8.2f} ms cum  {row['own_ms_per_step']:7.2f} own  {row['function']}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
