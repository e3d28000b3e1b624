"""How many samples the clipped sums' guard (:mod:`dpzoo.grad_norms.sum_guard`) sends to float64,
per parameter, on a benchmark config's dpzoo step: the cost of SUM_SLACK on real shapes.

    python benchmarks/sum_guard_share.py gpt2-small-t1024 --device cuda --precision bf16

A sample takes the float64 sum of a parameter where its norm is below κ · U (U = Σ_t ‖L_t‖‖R_t‖);
κ grows with T and is 4× larger on tensor cores, so bf16 at T 1,024 is where ordinary data could
start to pay. Prints, and writes as JSON (``--out``), per step the samples sent to float64 and
the smallest ‖g‖ / (κ U) of each parameter with a factored use (below 1: float64). The config's
data are the benchmark's random tokens or pixels, not real text: read it as a check, not a claim
about every dataset. Not a test: the ratios depend on the model's weights and data.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_modes  # noqa: E402

from dpzoo.grad_norms import sum_guard  # noqa: E402


def watch(records: list) -> object:
    """Wrap ``sum_guard.risky_samples`` so each call appends {param: (samples sent, min ratio)}."""
    inner = sum_guard.risky_samples

    def recorded(grads: dict):
        risky, flags = inner(grads)
        row = {}
        for name in risky:
            g = grads[name]
            k = max(map(sum_guard.kappa, g.reps))
            ratio = g.sq_norm().double().sqrt() / (k * g.triangle_bound())
            row[name] = (int(risky[name].sum()), float(ratio.min()))
        records.append(row)
        return risky, flags

    sum_guard.risky_samples = recorded
    return inner


def share(config: str, mode: str, device: str, precision: str, steps: int) -> dict:
    records: list = []
    inner = watch(records)
    try:
        run = bench_modes.make_runner(config, mode, device, precision)
        for _ in range(steps):
            run.train_step(run.next_batch())
    finally:
        sum_guard.risky_samples = inner
    last = records[-1] if records else {}
    batch = bench_modes.ALL_CONFIGS[config]["batch"]
    return {
        "config": config, "mode": mode, "device": device, "precision": precision, "steps": steps,
        "batch": batch, "calls": len(records),
        "samples_to_float64": [sum(n for n, _ in r.values()) for r in records],
        "params_with_factored_uses": len(last),
        "min_ratio": min((m for _, m in last.values()), default=None),
        "per_param_last_step": {k: {"float64_samples": n, "min_ratio": m} for k, (n, m) in sorted(last.items())},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", choices=list(bench_modes.ALL_CONFIGS))
    parser.add_argument("--mode", default="dpzoo-bk-mixopt")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32", choices=bench_modes.PRECISIONS)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    result = share(args.config, args.mode, args.device, args.precision, args.steps)
    worst = sorted(result["per_param_last_step"].items(), key=lambda kv: kv[1]["min_ratio"])[:5]
    print(f"{args.config} {args.mode} {args.precision}: samples sent to float64 per step "
          f"{result['samples_to_float64']} (batch {result['batch']}, {result['params_with_factored_uses']} "
          f"parameters with factored uses); smallest ||g||/(kappa U): "
          + ", ".join(f"{k} {v['min_ratio']:.3g}" for k, v in worst))  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
