"""Two routes to a convolution's per-sample weight gradients on a CPU, timed per layer shape: the
patches unfolded and multiplied per sample (``unfold``), or one convolution's weight gradient with
the batch folded into its groups (``grouped``, no patches). Each route as the instantiation path
runs it: the per-sample gradients, their squared norms and the clipped sum
(:class:`~dpzoo.grad_norms.param_grad.ParamGrad` with ``ghost=False``), routes interleaved, the
faster of ``--repeats`` runs each. Sets :data:`dpzoo.grad_norms.rules.conv.GROUPED_MIN_POSITIONS`
(output positions per input channel of a group).

    python benchmarks/conv_routes.py --out benchmarks/results/conv_routes
    python benchmarks/conv_routes.py --steps-of resnet18-gn-bias@128 --out benchmarks/results/conv_routes

Writes ``conv_routes.json``; with ``--steps-of CONFIG``, ``steps_<config>.json`` instead: whole
training steps of each mode (``--modes``) with the grouped route allowed (the threshold as set) and
with it off, two runners built alike, their steps interleaved round by round (the order rotated),
the ratio per round of the medians (allowed / off). Not a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from torch import nn

from dpzoo.grad_norms.param_grad import ParamGrad
from dpzoo.grad_norms.rules import conv

# (B, C_in, C_out, H, kernel, stride): ResNet stages at 32²-224² inputs and their stems
SHAPES = [
    (32, 3, 64, 32, 7, 2),
    (32, 64, 64, 8, 3, 1),
    (32, 64, 64, 16, 3, 1),
    (32, 64, 64, 32, 3, 1),
    (16, 64, 64, 56, 3, 1),
    (32, 128, 128, 8, 3, 1),
    (32, 128, 128, 16, 3, 1),
    (16, 128, 128, 28, 3, 1),
    (32, 256, 256, 4, 3, 1),
    (32, 256, 256, 8, 3, 1),
    (16, 256, 256, 14, 3, 1),
    (16, 512, 512, 7, 3, 1),
    (32, 64, 128, 16, 1, 2),
    (16, 256, 1024, 14, 1, 1),
]


def _time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, 1000 * (time.perf_counter() - start))
    return best


def measure(repeats: int, threshold: float) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b, cin, cout, h, k, s in SHAPES:
        module = nn.Conv2d(cin, cout, k, s, k // 2, bias=False)
        x = torch.randn(b, cin, h, h, generator=gen)
        out = (h + 2 * (k // 2) - k) // s + 1
        grad = torch.randn(b, cout, out, out, generator=gen)
        scale = torch.rand(b, generator=gen)
        times = {}
        for route, forced in (("unfold", float("inf")), ("grouped", 0)):
            conv.GROUPED_MIN_POSITIONS = forced

            def run():
                rep = conv.conv_rule(module, (x,), grad, {"weight"})["weight"]
                one = ParamGrad([rep], False)
                one.sq_norm()
                one.clipped_sum(scale)

            times[route] = _time(run, repeats)
        rows.append({"B": b, "C_in": cin, "C_out": cout, "H": h, "kernel": k, "stride": s, "T": out * out,
                     "unfold_ms": times["unfold"], "grouped_ms": times["grouped"],
                     "rule_picks": "grouped" if out * out >= threshold * cin else "unfold"})  # fmt: skip
    return rows


def step_rounds(config: str, modes: list[str], rounds: int, steps: int) -> dict:
    import statistics
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_modes

    allowed = conv.GROUPED_MIN_POSITIONS
    out = {}
    for mode in modes:
        runs = {"grouped": bench_modes.make_runner(config, mode), "unfold": bench_modes.make_runner(config, mode)}
        thresholds = {"grouped": allowed, "unfold": float("inf")}
        ms = {k: [] for k in runs}
        for r in range(rounds + 1):  # round 0 warms up
            order = list(runs) if r % 2 else list(runs)[::-1]
            per = {k: [] for k in runs}
            for _ in range(steps):
                for k in order:
                    conv.GROUPED_MIN_POSITIONS = thresholds[k]
                    per[k].append(1000 * runs[k].step())
            if r:
                for k in runs:
                    ms[k].append(statistics.median(per[k]))
        conv.GROUPED_MIN_POSITIONS = allowed
        ratios = [g / u for g, u in zip(ms["grouped"], ms["unfold"])]
        out[mode] = {"round_ms": ms, "ratio_median": statistics.median(ratios), "ratio_low": min(ratios),
                     "ratio_high": max(ratios)}  # fmt: skip
        print(f"{config} {mode}: grouped {statistics.median(ms['grouped']):.1f} ms, unfold "
              f"{statistics.median(ms['unfold']):.1f} ms, ratio {out[mode]['ratio_median']:.2f} "
              f"[{min(ratios):.2f}-{max(ratios):.2f}]")  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/conv_routes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps-of", default=None, help="a bench_modes config: time whole steps instead")
    ap.add_argument("--modes", nargs="+", default=["dpzoo-bk-mixopt", "dpzoo-instantiate"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.steps_of:
        result = {"machine": {"platform": platform.platform(), "threads": torch.get_num_threads(),
                              "torch": torch.__version__}, "config": args.steps_of,
                  "grouped_min_positions": conv.GROUPED_MIN_POSITIONS,
                  "modes": step_rounds(args.steps_of, args.modes, args.rounds, args.steps)}  # fmt: skip
        (out / f"steps_{args.steps_of.replace('@', '_')}.json").write_text(json.dumps(result, indent=1) + "\n")
        return
    before = conv.GROUPED_MIN_POSITIONS
    try:
        rows = measure(args.repeats, before)
    finally:
        conv.GROUPED_MIN_POSITIONS = before
    result = {"machine": {"platform": platform.platform(), "threads": torch.get_num_threads(), "torch": torch.__version__},
              "grouped_min_positions": before, "shapes": rows}  # fmt: skip
    (out / "conv_routes.json").write_text(json.dumps(result, indent=1) + "\n")
    for r in rows:
        print(f"B{r['B']:3d} {r['C_in']:4d}->{r['C_out']:4d} k{r['kernel']} T {r['T']:5d}: "
              f"unfold {r['unfold_ms']:8.2f} ms  grouped {r['grouped_ms']:8.2f} ms  ({r['unfold_ms'] / r['grouped_ms']:.2f}x)"
              f"  rule: {r['rule_picks']}")  # fmt: skip


if __name__ == "__main__":
    main()
