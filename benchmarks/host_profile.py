"""Where a training step's host time goes: Python's cProfile over a few steps of one mode of a
benchmark config, by function (own time and time including callees), for steps bound by the host
(a GPU waiting on Python: the 1.1B llama's DP-BiTFiT, 2026-11-28, ran ~76 ms of kernels in a 160 ms
step). ``profile_step.py`` gives the device's side (kernels by operator); this gives the host's.

Writes ``host_<config>_<mode>_<precision>.json`` (the step time with and without the profiler, the
top functions by own and by cumulative time per step) and prints the top rows. Not a test: timings
depend on the machine; cProfile slows Python-heavy code, so read the shares, not the times.

    python benchmarks/host_profile.py llama-22x64-t16 dpzoo-bitfit              # a CPU proxy
    python benchmarks/host_profile.py llama-bias-1b-t512 dpzoo-bitfit --device cuda --precision bf16

cProfile sees the main thread only: on a GPU the backward's hooks run on autograd's device thread.
``--time module:function`` (or ``module:Class.method``) times those functions on every thread, by
wall clock, in steps run without the profiler (``timed``: calls and ms per step, outermost calls).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import importlib
import json
import pstats
import sys
import threading
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


@contextlib.contextmanager
def wall_timers(specs: list[str]):
    """{spec: [seconds, calls]} of each ``module:function`` / ``module:Class.method`` while inside,
    counting a thread's outermost call only; the functions (and their names imported elsewhere in
    dpzoo) are restored after."""
    acc = {spec: [0.0, 0] for spec in specs}
    patched: list[tuple[object, str, object]] = []
    for spec in specs:
        module, _, attr = spec.partition(":")
        owner: object = importlib.import_module(module)
        *path, leaf = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        real = getattr(owner, leaf)
        inside = threading.local()

        @functools.wraps(real)
        def timed(*args, _real=real, _inside=inside, _acc=acc[spec], **kwargs):
            depth = getattr(_inside, "depth", 0)
            _inside.depth = depth + 1
            start = time.perf_counter()
            try:
                return _real(*args, **kwargs)
            finally:
                _inside.depth = depth
                if not depth:
                    _acc[0] += time.perf_counter() - start
                    _acc[1] += 1

        owners = [owner] if path else [owner] + [
            m for m in list(sys.modules.values()) if m is not owner and getattr(m, "__name__", "").startswith("dpzoo")
            and getattr(m, leaf, None) is real
        ]  # fmt: skip
        for o in owners:
            patched.append((o, leaf, real))
            setattr(o, leaf, timed)
    try:
        yield acc
    finally:
        for o, leaf, real in reversed(patched):
            setattr(o, leaf, real)


def host_profile(
    config: str, mode: str, device: str, precision: str, steps: int, top: int, time_specs: list[str] = ()
) -> dict:
    run = bench_modes.make_runner(config, mode, device, precision)
    for _ in range(3):  # warm-up: the first steps plan, check and compile
        run.train_step(run.next_batch())
    plain = _timed_steps(run, steps)
    timed = []
    if time_specs:
        with wall_timers(list(time_specs)) as acc:
            timed_step = _timed_steps(run, steps)
        timed = [
            {"function": k, "calls_per_step": n / steps, "ms_per_step": s * 1e3 / steps} for k, (s, n) in acc.items()
        ]
        timed.insert(
            0, {"function": "(the step, under these timers)", "calls_per_step": 1.0, "ms_per_step": timed_step * 1e3}
        )
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
        "timed": timed,
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
    parser.add_argument(
        "--time", nargs="*", default=[], metavar="MODULE:FUNCTION", help="wall-clock timers, every thread"
    )
    args = parser.parse_args(argv)
    result = host_profile(args.config, args.mode, args.device, args.precision, args.steps, args.top, args.time)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"host_{args.config}_{args.mode}_{args.precision}.json".replace("@", "_")
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{args.config} {args.mode}: {result['step_ms']:.1f} ms/step ({result['profiled_step_ms']:.1f} profiled)")
    for row in result["by_cumulative_time"][:25]:
        print(f"  {row['cumulative_ms_per_step']:8.2f} ms cum  {row['own_ms_per_step']:7.2f} own  {row['function']}")
    for row in result["timed"]:
        print(f"  {row['ms_per_step']:8.2f} ms  {row['calls_per_step']:7.1f} calls  {row['function']} (timed)")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
