"""The CPU planner's constant, measured: each path of a linear use (ghost norm or instantiation,
each with its norm, float guard and clipped sum as a step runs them: ``cost.measure_paths``) timed
on this machine for the layer shapes of the CPU benchmark configs, beside the multiply-add model's
estimate of each (``cost.use_cost``), and the range of ``TRAFFIC`` (multiply-adds charged per
instantiated element) for which the model orders every shape's two paths as measured.

    python benchmarks/planner_cpu.py --out benchmarks/results/planner_cpu

Writes ``planner_cpu.json``: per shape the two times (the faster of ``--repeats`` runs, each
``measure_paths``' own best of two), the model's counts, and the fitted interval; the interval is
empty when no single constant orders every shape (then it reports the constant that misorders
the fewest, weighted by the time a wrong choice costs). Not a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from dpzoo.grad_norms import cost
from dpzoo.grad_norms import reps as R

# (name, B, T, p, d): Factored uses of the CPU configs' layers (bench_modes)
SHAPES = [
    ("gpt2-4x256 attn.c_proj", 16, 128, 256, 256),
    ("gpt2-4x256 attn.c_attn", 16, 128, 256, 768),
    ("gpt2-4x256 mlp.c_fc", 16, 128, 256, 1024),
    ("gpt2-4x256 mlp.c_proj", 16, 128, 1024, 256),
    ("resnet18@32 conv1 (7x7/2)", 32, 256, 147, 64),
    ("resnet18@32 layer1", 32, 64, 576, 64),
    ("resnet18@32 layer2.0.conv1", 32, 16, 576, 128),
    ("resnet18@32 layer2", 32, 16, 1152, 128),
    ("resnet18@32 layer2 downsample", 32, 16, 64, 128),
    ("resnet18@32 layer3", 32, 4, 2304, 256),
    ("resnet18@32 layer4", 32, 1, 4608, 512),
    ("resnet18@32 fc", 32, 1, 512, 10),
]


def _rep(b: int, t: int, p: int, d: int, gen: torch.Generator) -> R.Factored:
    return R.Factored(torch.randn(b, 1, t, p, generator=gen), torch.randn(b, 1, t, d, generator=gen), (d, p))


def measure(repeats: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, b, t, p, d in SHAPES:
        rep = _rep(b, t, p, d, gen)
        times = []
        for _ in range(repeats):
            cost.MEASURED.clear()  # measure_paths caches per shape: time it afresh
            times.append(cost.measure_paths(rep))
        ghost_ms, inst_ms = min(x[0] for x in times), min(x[1] for x in times)
        c = cost.use_cost(name, 0, rep)
        arithmetic = c.instantiate_flops - (2 + cost.TRAFFIC) * b * p * d  # without the traffic term
        rows.append({"use": name, "B": b, "T": t, "p": p, "d": d, "ghost_ms": ghost_ms, "instantiate_ms": inst_ms,
                     "ghost_madds": c.ghost_flops, "instantiate_madds_without_traffic": arithmetic,
                     "elements": b * p * d})  # fmt: skip
    return rows


def fit(rows: list[dict]) -> dict:
    """The TRAFFIC values for which ghost_madds < instantiate(TRAFFIC) exactly where ghost was faster:
    instantiation's count is arithmetic + (2 + TRAFFIC)·elements, so each shape bounds TRAFFIC on one side."""
    low, high, misses = 0.0, float("inf"), []
    for r in rows:
        at = (r["ghost_madds"] - r["instantiate_madds_without_traffic"]) / r["elements"] - 2  # the tie
        if r["ghost_ms"] < r["instantiate_ms"]:  # the model picks ghost iff TRAFFIC > the tie
            low = max(low, at)
            r["traffic_tie"], r["faster"] = at, "ghost"
        else:
            high = min(high, at)
            r["traffic_tie"], r["faster"] = at, "instantiate"
    if low <= high:
        return {"traffic_low": low, "traffic_high": high, "consistent": True}
    grid = sorted({r["traffic_tie"] for r in rows} | {0.0})
    best = min(grid, key=lambda x: sum(_regret(r, x) for r in rows))
    misses = [r["use"] for r in rows if _regret(r, best) > 0]
    return {"traffic_low": low, "traffic_high": high, "consistent": False, "best": best, "misordered": misses}


def _regret(r: dict, traffic: float) -> float:
    """Milliseconds lost on ``r`` when the model with ``traffic`` picks its slower path."""
    ghost_by_model = r["ghost_madds"] < r["instantiate_madds_without_traffic"] + (2 + traffic) * r["elements"]
    return max(0.0, (r["ghost_ms"] - r["instantiate_ms"]) if ghost_by_model else (r["instantiate_ms"] - r["ghost_ms"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/planner_cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = measure(args.repeats)
    result = {"machine": {"platform": platform.platform(), "threads": torch.get_num_threads(), "torch": torch.__version__},
              "current_traffic": cost.TRAFFIC, "fit": fit(rows), "uses": rows}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "planner_cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    for r in rows:
        print(f"{r['use']:32s} ghost {r['ghost_ms']:8.2f} ms  instantiate {r['instantiate_ms']:8.2f} ms  "
              f"tie at TRAFFIC {r['traffic_tie']:9.1f}  ({r['faster']} faster)")  # fmt: skip
    print(json.dumps(result["fit"]))


if __name__ == "__main__":
    main()
