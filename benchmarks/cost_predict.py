"""A code change's predicted GPU effect, without a GPU: trace the working tree's training steps
(:mod:`cost_trace`, the same counts on any machine) and price them with the GPU model's constants
as ``cost_report.py`` last calibrated them (``benchmarks/results/cost/cost_report.json``).

    python benchmarks/cost_predict.py --config gpt2-small-t128 --precision bf16 \\
        --modes nonprivate-full dpzoo-instantiate dpzoo-bitfit --out after.json

Run it on the commits before and after a change (a clone each) and compare the JSON files: the
counts are exact, the times a model's (docs/RESULTS.md gives its error). Writes per mode the
operators, host reads, Python calls and the predicted H100/H200 step time and its ratio to the
first mode's.
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

REPORT = Path(__file__).resolve().parent / "results" / "cost" / "cost_report.json"


def predict(config: str, precision: str, modes: list[str], report: Path = REPORT) -> dict:
    constants = json.loads(report.read_text())["validation"]["constants"]
    devices = {k: dataclasses.replace(d, **constants) for k, d in gpu_model.DEVICES.items()}
    rows = {}
    for mode in modes:
        trace = cost_trace.trace_step(config, mode, precision)
        counts = cost_trace.summarize(trace)
        shaped = gpu_model.arrays(trace)
        rows[mode] = {k: counts[k] for k in ("ops", "host_reads", "python_calls")}
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
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "command": "python benchmarks/cost_predict.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "git_commit": commit,
        "constants_from": str(REPORT.relative_to(REPORT.parents[2])),
        "config": args.config,
        "precision": args.precision,
        "modes": predict(args.config, args.precision, args.modes),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["modes"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
