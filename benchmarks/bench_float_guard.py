"""What the rigorous rounding bound on ghost norms costs (grad_norms/rounding.py, float_guard.py).

Per config, one process, the dpzoo bk-mixopt step:

* **inflation**: for every ghost-path parameter and sample, the bound E over the computed squared
  norm S; the share of samples recomputed in float64 (E > LOOSE·S, or the old recheck line), and
  the norm inflation √((S+E)/S) − 1 of the others, as quantiles. Also the shares that other LOOSE
  values would recompute, read off the same E/S values.
* **time**: the whole training step with today's guard against the guard before the bound (floor
  and float64 recheck only, kept here as the baseline), interleaved step by step over rounds with
  the order rotated each round; the ratio per round, its median and min-max.

Random weights and random tokens/pixels (``bench_modes.build``): real text makes activations more
correlated, so E/S smaller. Writes ``float_guard.json`` and ``float_guard.png`` to ``--out``.

    python benchmarks/bench_float_guard.py --out benchmarks/results/float_guard
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from bench_modes import ALL_CONFIGS, make_runner

from dpzoo.grad_norms import float_guard, rounding

_LM = dict(kind="lm", vocab=1024, heads=12, tied=True)
CONFIGS = {
    "gpt2-4x256-v1024-tied": ALL_CONFIGS["gpt2-4x256-v1024-tied"],
    "gpt2-2x768-t128": dict(_LM, layers=2, width=768, batch=8, seq=128),
    "gpt2-2x768-t512": dict(_LM, layers=2, width=768, batch=4, seq=512),
    "resnet18-gn-bias@32": ALL_CONFIGS["resnet18-gn-bias@32"],
    "transformer-seqrec-ml1m": ALL_CONFIGS["transformer-seqrec-ml1m"],
}
LOOSE_SWEEP = [2.0**-8, 2.0**-6, 2.0**-4, 2.0**-2]


def guard_before(reps: list, total: torch.Tensor) -> torch.Tensor:
    """The guard before the rounding bound: floor at (GHOST_FLOOR·U)², float64 recheck below RECHECK·U."""
    bound = sum(float_guard.triangle_bound(r) for r in reps)
    floor = (float_guard.GHOST_FLOOR * bound).square()
    out = total.double()
    low = out < (float_guard.RECHECK * bound).square() if total.dtype != torch.float64 else out < floor
    if low.any():
        rows = low.nonzero().squeeze(1)
        out = out.index_copy(0, rows, float_guard.sq_norm64(reps, rows))
    return torch.maximum(out, floor).to(total.dtype)


def record_ratios(ratios: list, rechecked: list):
    """A guard that records, per sample, E/S and whether today's guard recomputes it, then guards."""
    today = float_guard.guard

    def recording(reps, total):
        sums = [float_guard.row_sums(r) for r in reps]
        bound = sum(s[0] for s in sums)
        err = rounding.error_bound(reps, sums, total.dtype)
        s = total.double().clamp_min(1e-300)
        ratios.extend((err / s).tolist())
        rechecked.extend((s < (float_guard.RECHECK * bound).square()).tolist())
        return today(reps, total)

    return recording


def quantiles(xs: list[float]) -> dict:
    if not xs:
        return {}
    qs = statistics.quantiles(xs, n=100, method="inclusive") if len(xs) > 1 else [xs[0]] * 99
    return {"p50": qs[49], "p90": qs[89], "p99": qs[98], "max": max(xs)}


def inflation(config: dict, steps: int) -> dict:
    ratios: list[float] = []
    rechecked: list[bool] = []
    run = make_runner(config, "dpzoo-bk-mixopt")
    today = float_guard.guard
    float_guard.guard = record_ratios(ratios, rechecked)
    try:
        for _ in range(steps):
            run.step()
    finally:
        float_guard.guard = today
    n = max(len(ratios), 1)  # 0 where the planner put every use on the instantiation path
    kept = [r for r, low in zip(ratios, rechecked) if r <= float_guard.LOOSE and not low]
    return {
        "samples_x_ghost_params": len(ratios),
        "recomputed_share": {
            str(lo): sum(r > lo or low for r, low in zip(ratios, rechecked)) / n for lo in LOOSE_SWEEP
        },
        "bound_over_norm": quantiles(ratios),
        "norm_inflation_kept": quantiles([(1 + r) ** 0.5 - 1 for r in kept]),
    }


def step_time_ratio(config: dict, rounds: int, steps: int) -> dict:
    runs = {"today": make_runner(config, "dpzoo-bk-mixopt"), "before": make_runner(config, "dpzoo-bk-mixopt")}
    guards = {"today": float_guard.guard, "before": guard_before}
    times: dict[str, list[list[float]]] = {k: [] for k in runs}
    order = list(runs)
    try:
        for name in order:  # warm-up
            float_guard.guard = guards[name]
            runs[name].step()
        for r in range(rounds):
            rot = order[r % 2 :] + order[: r % 2]
            per = {k: [] for k in runs}
            for _ in range(steps):
                for name in rot:
                    float_guard.guard = guards[name]
                    per[name].append(runs[name].step())
            for k in runs:
                times[k].append(per[k])
    finally:
        float_guard.guard = guards["today"]
    per_round = [statistics.median(t) / statistics.median(b) for t, b in zip(times["today"], times["before"])]
    return {
        "ratio_median": statistics.median(per_round),
        "ratio_min": min(per_round),
        "ratio_max": max(per_round),
        "before_s": statistics.median(s for rr in times["before"] for s in rr),
    }


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(data["configs"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for lo in map(str, LOOSE_SWEEP):
        axes[0].plot(names, [data["configs"][n]["inflation"]["recomputed_share"][lo] for n in names], "o-", label=lo)
    axes[0].set_ylabel("share of (sample, ghost parameter) recomputed in float64")
    axes[0].legend(title="LOOSE")
    med = [data["configs"][n]["time"]["ratio_median"] for n in names]
    lo_err = [m - data["configs"][n]["time"]["ratio_min"] for m, n in zip(med, names)]
    hi_err = [data["configs"][n]["time"]["ratio_max"] - m for m, n in zip(med, names)]
    axes[1].errorbar(names, med, yerr=[lo_err, hi_err], fmt="o")
    axes[1].axhline(1.0, color="grey", lw=0.5)
    axes[1].set_ylabel("step time, bound / before (median, min-max)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/float_guard")
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2, help="steps per mode per round")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    data = {"loose": float_guard.LOOSE, "configs": {}}
    for name in args.configs:
        cfg = CONFIGS[name]
        t0 = time.perf_counter()
        data["configs"][name] = {"inflation": inflation(cfg, 2), "time": step_time_ratio(cfg, args.rounds, args.steps)}
        print(name, json.dumps(data["configs"][name]), f"({time.perf_counter() - t0:.0f} s)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "float_guard.json").write_text(json.dumps(data, indent=1) + "\n")
    plot(data, out / "float_guard.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
