"""What a DP step must compute on the CPU configurations, counted (not timed): FLOPs, bytes moved
and operators of one traced step per mode (:mod:`cost_trace`, the same on any machine), beside the
non-private step's. It says how close to the physical floor a mode can get by arithmetic alone:
the floor (the non-private step plus the noise) adds almost no FLOPs, so a mode that computes more
than the floor's FLOPs cannot reach it on a compute-bound CPU whatever its implementation.

    python benchmarks/floor_flops.py --out benchmarks/results/floor

Writes ``flops.json``: per configuration and mode the counts and their ratios to non-private full
training.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cost_trace  # noqa: E402

CONFIGS = ("gpt2-4x256-v1024-tied", "resnet18-gn-bias@32")
MODES = ("nonprivate-full", "dpzoo-bk-mixopt", "dpzoo-bk", "dpzoo-instantiate")


def count(config: str, mode: str) -> dict:
    s = cost_trace.summarize(cost_trace.trace_step(config, mode, "fp32", cpu_routes=True))
    return {"gflops": sum(s["gflops"].values()), "gbytes": s["gbytes"], "ops": s["ops"], "host_reads": s["host_reads"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    result: dict = {"precision": "fp32", "configs": {}}
    for config in args.configs:
        counts = {mode: count(config, mode) for mode in MODES}
        base = counts["nonprivate-full"]
        for c in counts.values():
            c["gflops_ratio"] = c["gflops"] / base["gflops"]
            c["gbytes_ratio"] = c["gbytes"] / base["gbytes"]
        result["configs"][config] = counts
        print(config, {m: round(c["gflops_ratio"], 3) for m, c in counts.items()}, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "flops.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
