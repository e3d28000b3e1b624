"""Reproduce the DPFormer paper's Table 1 (MovieLens-1M) within a CPU budget.

Stages (each run is saved as JSON and skipped when it already exists, so the script resumes):
1. learning-rate grid, seed 0, at the first ε, for every model;
2. more seeds at each model's best learning rate (chosen on the *validation* NDCG@10 of the
   last evaluation, never on test);
3. the other ε values, one seed, at the same learning rate.
Then ``summary.json`` and ``summary.md`` (mean ± std over seeds of the last evaluation's test
NDCG@10 / HIT@10) are written. The paper trains 100 epochs at max length 200 with a 5×5 grid of
learning rate and batch size; the defaults here are what a 2-core CPU allows in about an hour
(see docs/RESULTS.md).

    python benchmarks/reproduce_dpformer_ml1m.py --out benchmarks/results/dpformer_ml1m
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

MODELS = ["dpformer", "transformer-seqrec", "transformer-seqrec-untied", "gru-seqrec", "lstm-seqrec"]
PAPER_EPS5 = {  # DPFormer paper Table 1, MovieLens-1M, ε = 5: (NDCG@10 %, HIT@10 %)
    "dpformer": (5.88, 11.13),
    "transformer-seqrec": (4.57, 8.69),
    "transformer-seqrec-untied": (2.33, 4.47),
    "lstm-seqrec": (2.65, 5.08),
    "gru-seqrec": (2.26, 4.58),
}


def use_data_dir(data_dir: str | None) -> None:
    """Point dpzoo's dataset lookup at ``data_dir`` (exported as ``$DPZOO_DATA``, which worker
    processes inherit). Default: ``$DPZOO_DATA`` if set, else ``../shared/data`` beside the repository
    when it exists; otherwise dpzoo's own cache directory."""
    if data_dir is None and not os.environ.get("DPZOO_DATA"):
        shared = Path(__file__).resolve().parents[2] / "shared" / "data"
        data_dir = str(shared) if shared.is_dir() else None
    if data_dir is not None:
        os.environ["DPZOO_DATA"] = str(Path(data_dir).resolve())


def run_one(args, model, eps, lr, bs, seed, runs: Path) -> dict:
    path = runs / f"{model}_eps{eps:g}_lr{lr:g}_bs{bs}_seed{seed}.json"
    if path.exists():
        done = json.loads(path.read_text())
        if done.get("item_prior", "none") != args.item_prior:  # runs before the prior existed had none
            raise SystemExit(
                f"{path} was trained with item_prior={done.get('item_prior', 'none')!r}, not {args.item_prior!r}: "
                "give another --out for runs with another prior."
            )
        return done
    if args.summary_only:
        print(f"missing (not trained, --summary-only): {path.name}", flush=True)
        return None
    from dpzoo.seqrec.train import train_seqrec

    t0 = time.time()
    tag = path.stem
    log = (lambda msg: print(f"[{tag}] {msg}", flush=True)) if args.verbose else (lambda *a: None)
    result = train_seqrec(
        model,
        data=args.data,
        epsilon=eps,
        epochs=args.epochs,
        batch_size=bs,
        lr=lr,
        max_len=args.max_len,
        eval_every=args.eval_every,
        seed=seed,
        item_prior=args.item_prior,
        max_physical_batch_size=args.max_physical_batch_size,
        device=args.device,
        log=log,
    )
    result["wall_seconds"] = time.time() - t0
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(path)  # never a half-written result
    last = result["history"][-1]
    print(
        f"{model:26s} ε={eps:<4g} lr={lr:<7g} B={bs:<5d} seed={seed}  valid NDCG@10 {100 * last['valid_ndcg@10']:.2f}%  "
        f"test NDCG@10 {100 * last['test_ndcg@10']:.2f}%  HIT@10 {100 * last['test_hit@10']:.2f}%  "
        f"({result['wall_seconds']:.0f}s)",
        flush=True,
    )
    return result


def run_many(args, jobs: list[tuple], runs: Path) -> list[dict]:
    """Run (model, eps, lr, seed) jobs, ``args.jobs`` at a time in spawned processes (CUDA-safe);
    small models leave an accelerator mostly idle, so several runs share it."""
    if args.jobs <= 1:
        return [r for r in (run_one(args, *job, runs) for job in jobs) if r is not None]
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as pool:
        futures = [pool.submit(run_one, args, *job, runs) for job in jobs]
        return [r for r in (f.result() for f in futures) if r is not None]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="ml-1m")
    p.add_argument(
        "--data-dir",
        default=None,
        help="folder holding the datasets (e.g. ml-1m/ml-1m.txt); default $DPZOO_DATA, else "
        "../shared/data beside the repository if present, else dpzoo's cache",
    )
    p.add_argument("--models", nargs="+", default=MODELS)
    p.add_argument("--epsilons", nargs="+", type=float, default=[5.0, 8.0, 10.0])
    p.add_argument("--lrs", nargs="+", type=float, default=[3e-3, 9e-3])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1024])
    p.add_argument("--max-len", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=1)
    p.add_argument(
        "--max-physical-batch-size",
        type=int,
        default=None,
        help="split logical batches into physical ones of this size (CPU memory)",
    )
    p.add_argument(
        "--item-prior",
        default="private",
        choices=["private", "public", "none"],
        help="the output bias's start (dpzoo.seqrec.item_prior): released inside ε, exact outside ε, or zero",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (processes)")
    p.add_argument("--out", default="benchmarks/results/dpformer_ml1m")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="print every evaluation of every run as it happens (partial results if a run is cut off)",
    )
    p.add_argument(
        "--summary-only",
        action="store_true",
        help="train nothing; summarise the runs already under OUT/runs (missing ones are listed)",
    )
    args = p.parse_args(argv)
    if args.data != "synthetic" and not args.summary_only:
        use_data_dir(args.data_dir)
    out = Path(args.out)
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    eps0 = args.epsilons[0]

    grid1 = [(m, eps0, lr, bs, 0) for m in args.models for lr in args.lrs for bs in args.batch_sizes]
    if len(args.lrs) * len(args.batch_sizes) == 1:
        # nothing to select: every run is known now, so all of them share the pool at once
        lr, bs = args.lrs[0], args.batch_sizes[0]
        run_many(
            args,
            grid1
            + [(m, eps0, lr, bs, seed) for seed in range(1, args.seeds) for m in args.models]
            + [(m, eps, lr, bs, 0) for eps in args.epsilons[1:] for m in args.models],
            runs,
        )
    stage1 = run_many(args, grid1, runs)  # with one grid point: already trained, read back
    best = {}
    for model in args.models:  # stage 1: best (lr, batch size) on validation NDCG@10, seed 0
        grid = {(r["lr"], r["batch_size"]): r for r in stage1 if r["model"] == model}
        if grid:  # empty only with --summary-only when none of its grid runs exists
            best[model] = max(grid, key=lambda k: grid[k]["history"][-1]["valid_ndcg@10"])
    # stage 2 (more seeds at ε0) and stage 3 (the other ε, seed 0), seeds interleaved across models
    later = [(m, eps0, *best[m], seed) for seed in range(1, args.seeds) for m in args.models if m in best]
    later += [(m, eps, *best[m], 0) for eps in args.epsilons[1:] for m in args.models if m in best]
    run_many(args, later, runs)

    summary = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "summary_only")},
        "best": {m: {"lr": lr, "batch_size": bs} for m, (lr, bs) in best.items()},
        "stage1": [
            {
                "model": r["model"],
                "lr": r["lr"],
                "batch_size": r["batch_size"],
                "valid_ndcg@10": r["history"][-1]["valid_ndcg@10"],
            }
            for r in stage1
        ],
        "results": [],
    }
    for eps in args.epsilons:
        for model in args.models:
            if model not in best:
                summary.setdefault("missing", []).append({"model": model, "epsilon": eps})
                continue
            rows = [
                json.loads(f.read_text())
                for f in sorted(runs.glob(f"{model}_eps{eps:g}_lr{best[model][0]:g}_bs{best[model][1]}_seed*.json"))
            ]
            if not rows:  # only with --summary-only: a run that was never finished
                summary.setdefault("missing", []).append({"model": model, "epsilon": eps})
                continue
            nd = [100 * r["history"][-1]["test_ndcg@10"] for r in rows]
            hit = [100 * r["history"][-1]["test_hit@10"] for r in rows]
            summary["results"].append(
                {
                    "model": model,
                    "epsilon": eps,
                    "lr": best[model][0],
                    "batch_size": best[model][1],
                    "seeds": len(rows),
                    "ndcg@10_mean": statistics.mean(nd),
                    "ndcg@10_std": statistics.stdev(nd) if len(nd) > 1 else 0.0,
                    "hit@10_mean": statistics.mean(hit),
                    "hit@10_std": statistics.stdev(hit) if len(hit) > 1 else 0.0,
                    "noise_multiplier": rows[0]["noise_multiplier"],
                    "sample_rate": rows[0]["sample_rate"],
                    "paper_eps5": PAPER_EPS5.get(model) if eps == 5 else None,
                }
            )
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [
        "| model | ε | lr | B | seeds | NDCG@10 (%) | HIT@10 (%) | paper NDCG@10 / HIT@10 (ε=5) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["results"]:
        paper = f"{r['paper_eps5'][0]} / {r['paper_eps5'][1]}" if r["paper_eps5"] else ""
        lines.append(
            f"| {r['model']} | {r['epsilon']:g} | {r['lr']:g} | {r['batch_size']} | {r['seeds']} | {r['ndcg@10_mean']:.2f} ± "
            f"{r['ndcg@10_std']:.2f} | {r['hit@10_mean']:.2f} ± {r['hit@10_std']:.2f} | {paper} |"
        )
    for m in summary.get("missing", []):
        lines.append(f"| {m['model']} | {m['epsilon']:g} | | | 0 | not run | not run | |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
