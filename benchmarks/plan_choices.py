"""The planner's choices (ghost norm or instantiation, per use of each layer) for a benchmark
config's dpzoo bk-mixopt step, by the multiply-add model and by timing (``autotune``), with the
mean step time of each: what ``autotune=None`` changes on a device.

    python benchmarks/plan_choices.py llama-bias-1b-t512 --device cuda --precision bf16

Prints one JSON line per plan: the choices counted, how many uses were timed, the first timed
uses' milliseconds and megabytes on each path. The two plans run one after the other in one
process (not interleaved): read their step times as a check, the interleaved benchmark
(bench_training_step.py) for ratios. Not a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_modes  # noqa: E402
import torch  # noqa: E402


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def plan_choices(config: str, device: str, precision: str, steps: int = 3) -> list[dict]:
    out = []
    for autotune in (False, True):
        run = bench_modes.make_runner(config, "dpzoo-bk-mixopt", device, precision)
        run.engine.hooks.autotune = autotune
        for _ in range(steps):  # the first steps plan (and, timed, measure each shape once)
            run.train_step(run.next_batch())
        _sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            run.train_step(run.next_batch())
        _sync(device)
        plan = run.engine.plan()
        timed = [r for r in plan if r.get("timed")]
        keys = ("param", "choice", "ghost_ms", "instantiate_ms", "ghost_mb", "instantiate_mb")
        out.append({"config": config, "autotune": autotune, "ms_per_step": 1000 * (time.perf_counter() - start) / steps,
                    "choices": collections.Counter(r["choice"] for r in plan), "timed": len(timed),
                    "timed_rows": [{k: r[k] for k in keys} for r in timed[:12]]})  # fmt: skip
        del run
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", choices=list(bench_modes.ALL_CONFIGS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default="bf16", choices=bench_modes.PRECISIONS)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    for row in plan_choices(args.config, args.device, args.precision, args.steps):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
