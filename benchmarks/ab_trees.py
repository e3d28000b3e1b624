"""Two checkouts of dpzoo timed against each other on one benchmark step, interleaved: the way
to measure a change's speed on a noisy machine (timings drift ±30% between runs here; rounds of
the two alternate in random order, so drift hits both alike).

    git worktree add /tmp/base <commit>
    python benchmarks/ab_trees.py /tmp/base . --config llama-22x64-t16 --mode dpzoo-bitfit \
        --rounds 12 --steps 5 --out benchmarks/results/ab/llama-22x64-t16_dpzoo-bitfit.json

Each tree runs in its own process (its dpzoo and its benchmarks/bench_modes.py first on the path,
one torch thread), builds the config's runner, warms up, then times ``--steps`` steps a round
when told. Writes, per tree, its commit and the seconds a step of every round, and the ratios
new / base per round (median and quartiles). CPU only: a step's time here, not a GPU's.

``--reuse-freed-memory``: each worker keeps freed memory (:mod:`dpzoo.cpu_allocator`). Without it
glibc's adaptive mmap threshold settles each process into one of two regimes: the same tree's
ResNet-18-GN@32 step ran at 175 or 220 ms depending on the process (2026-11-28, five A/B runs of
one change gave new/base from 0.79 to 1.12), so a default-allocator comparison measures which
regime each worker fell into, not the change.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path


def worker(tree: str, config: str, mode: str, steps: int, reuse_freed_memory: bool = False) -> None:
    """Serve rounds on stdin: each line, ``steps`` steps timed, seconds a step printed."""
    import warnings

    warnings.filterwarnings("ignore")
    tree = str(Path(tree).resolve())
    sys.path[:0] = [tree, str(Path(tree) / "benchmarks")]
    import torch

    torch.set_num_threads(1)
    if reuse_freed_memory:
        from dpzoo.cpu_allocator import reuse_freed_memory as keep

        keep()
    import bench_modes

    import dpzoo

    if not str(Path(dpzoo.__file__).resolve()).startswith(tree):
        raise SystemExit(f"{tree}: imported dpzoo from {dpzoo.__file__}")
    run = bench_modes.make_runner(bench_modes.ALL_CONFIGS[config], mode, "cpu", "fp32")
    for _ in range(3):
        run.train_step(run.next_batch())
    print("ready", flush=True)
    for _ in sys.stdin:
        start = time.perf_counter()
        for _ in range(steps):
            run.train_step(run.next_batch())
        print(json.dumps((time.perf_counter() - start) / steps), flush=True)


def compare(
    base: str,
    new: str,
    config: str,
    mode: str,
    rounds: int,
    steps: int,
    seed: int = 0,
    reuse_freed_memory: bool = False,
) -> dict:
    trees = {"base": base, "new": new}
    procs = {
        k: subprocess.Popen(
            [sys.executable, __file__, "--worker", t, "--config", config, "--mode", mode, "--steps", str(steps)]
            + (["--reuse-freed-memory"] if reuse_freed_memory else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for k, t in trees.items()
    }
    times: dict[str, list[float]] = {k: [] for k in trees}
    try:
        for k, p in procs.items():
            if p.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
                raise SystemExit(f"the {k} tree's worker did not start (run it with --worker to see why)")
        order = random.Random(seed)
        for _ in range(rounds):
            for k in order.sample(list(trees), len(trees)):
                procs[k].stdin.write("go\n")  # type: ignore[union-attr]
                procs[k].stdin.flush()  # type: ignore[union-attr]
                times[k].append(json.loads(procs[k].stdout.readline()))  # type: ignore[union-attr]
    finally:
        for p in procs.values():
            p.stdin.close()  # type: ignore[union-attr]
            p.wait()
    ratios = sorted(n / b for n, b in zip(times["new"], times["base"]))
    quartiles = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else [ratios[0]] * 3
    return {
        "config": config, "mode": mode, "rounds": rounds, "steps_per_round": steps,
        "reuse_freed_memory": reuse_freed_memory,
        "trees": {k: {"path": t, "commit": _commit(t), "seconds_per_step": times[k],
                      "median_ms": 1e3 * statistics.median(times[k])} for k, t in trees.items()},
        "ratio_new_to_base": {"median": statistics.median(ratios), "q1": quartiles[0], "q3": quartiles[2]},
    }  # fmt: skip


def _commit(tree: str) -> str:
    out = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "-C", tree, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    )
    return out.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="*", help="BASE NEW: two checkouts of dpzoo")
    parser.add_argument("--config", required=True)
    parser.add_argument("--mode", required=True)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--reuse-freed-memory", action="store_true",
                        help="each worker keeps freed memory (dpzoo.cpu_allocator): stable timings")  # fmt: skip
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.config, args.mode, args.steps, args.reuse_freed_memory)
        return 0
    if len(args.trees) != 2:
        parser.error("give two trees: BASE NEW")
    result = compare(
        *args.trees, args.config, args.mode, args.rounds, args.steps, reuse_freed_memory=args.reuse_freed_memory
    )
    r = result["ratio_new_to_base"]
    ms = {k: v["median_ms"] for k, v in result["trees"].items()}
    print(f"{args.config} {args.mode}: base {ms['base']:.2f} ms, new {ms['new']:.2f} ms a step; new/base median "
          f"{r['median']:.3f} (quartiles {r['q1']:.3f}-{r['q3']:.3f}, {args.rounds} rounds of {args.steps} steps)")  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
