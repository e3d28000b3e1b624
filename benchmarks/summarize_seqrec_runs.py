"""Summarise sequential-recommendation runs: one row per (model, ε, lr, B), mean ± std over seeds.

Reads run JSONs (what ``reproduce_dpformer_ml1m.py`` and ``train_seqrec`` write) and, for runs
whose JSON was lost, the evaluation lines that ``--verbose`` / ``train_seqrec(log=...)`` print,
tagged ``[MODEL sSEED]`` (test metrics only; the run's settings are given on the command line).
Also writes the per-seed difference dpformer − transformer-seqrec where both ran with the same
seed and settings (same seed: same initialisation, Poisson batches and noise draws).

    python benchmarks/summarize_seqrec_runs.py benchmarks/results/dpformer_ml1m/gpu100
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^\[(?P<model>[\w-]+) s(?P<seed>\d+)\] epoch (?P<epoch>\d+): test NDCG@10 (?P<ndcg>[\d.]+)%  "
                  r"HIT@10 (?P<hit>[\d.]+)%")


def from_json(path: Path) -> dict:
    r = json.loads(path.read_text())
    last = r["history"][-1]
    return {"model": r["model"], "epsilon": r.get("epsilon_target"), "lr": r["lr"], "batch_size": r["batch_size"],
            "epochs": r["epochs"], "seed": r["seed"], "ndcg": 100 * last["test_ndcg@10"],
            "hit": 100 * last["test_hit@10"], "noise_multiplier": r.get("noise_multiplier"),
            "curve": [(h["epoch"], 100 * h["test_ndcg@10"]) for h in r["history"]], "source": path.name}


def from_log(path: Path, epsilon: float, lr: float, batch_size: int, epochs: int) -> list[dict]:
    curves = defaultdict(list)
    for line in path.read_text().splitlines():
        m = LINE.match(line)
        if m:
            curves[(m["model"], int(m["seed"]))].append((int(m["epoch"]), float(m["ndcg"]), float(m["hit"])))
    runs = []
    for (model, seed), rows in curves.items():
        rows.sort()
        if rows[-1][0] != epochs:
            raise SystemExit(f"{path}: {model} seed {seed} stops at epoch {rows[-1][0]}, not {epochs}")
        runs.append({"model": model, "epsilon": epsilon, "lr": lr, "batch_size": batch_size, "epochs": epochs,
                     "seed": seed, "ndcg": rows[-1][1], "hit": rows[-1][2], "noise_multiplier": None,
                     "curve": [(e, n) for e, n, _ in rows], "source": path.name})
    return runs


def summarise(runs: list[dict]) -> dict:
    groups = defaultdict(list)
    for r in runs:
        groups[(r["model"], r["epsilon"], r["lr"], r["batch_size"], r["epochs"])].append(r)
    rows = []
    for (model, eps, lr, bs, epochs), rs in sorted(groups.items(), key=lambda kv: (
            kv[0][1] if kv[0][1] is not None else float("inf"), kv[0][3], kv[0][2], kv[0][0])):
        rs.sort(key=lambda r: r["seed"])
        nd, hit = [r["ndcg"] for r in rs], [r["hit"] for r in rs]
        rows.append({"model": model, "epsilon": eps, "lr": lr, "batch_size": bs, "epochs": epochs,
                     "seeds": [r["seed"] for r in rs], "ndcg@10": nd, "hit@10": hit,
                     "ndcg@10_mean": statistics.mean(nd), "ndcg@10_std": statistics.stdev(nd) if len(nd) > 1 else 0.0,
                     "hit@10_mean": statistics.mean(hit), "hit@10_std": statistics.stdev(hit) if len(hit) > 1 else 0.0,
                     "sources": [r["source"] for r in rs]})
    paired = []
    by_key = {(r["model"], r["epsilon"], r["lr"], r["batch_size"], r["epochs"], r["seed"]): r for r in runs}
    order = lambda kv: (kv[0][1] if kv[0][1] is not None else float("inf"), kv[0][3], kv[0][2], kv[0][5])
    for (model, *rest), r in sorted(by_key.items(), key=order):
        other = by_key.get(("transformer-seqrec", *rest))
        if model == "dpformer" and other is not None:
            paired.append({"epsilon": rest[0], "lr": rest[1], "batch_size": rest[2], "epochs": rest[3], "seed": rest[4],
                           "ndcg@10_diff": r["ndcg"] - other["ndcg"],
                           "max_abs_curve_diff": max(abs(a[1] - b[1]) for a, b in zip(r["curve"], other["curve"]))})
    return {"groups": rows, "dpformer_minus_transformer": paired}


def markdown(summary: dict) -> str:
    lines = ["| model | ε | lr | B | epochs | seeds | NDCG@10 (%) | HIT@10 (%) | per seed NDCG@10 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for g in summary["groups"]:
        eps = "non-private" if g["epsilon"] is None else f"{g['epsilon']:g}"
        lines.append(f"| {g['model']} | {eps} | {g['lr']:g} | {g['batch_size']} | {g['epochs']} | {len(g['seeds'])} | "
                     f"{g['ndcg@10_mean']:.2f} ± {g['ndcg@10_std']:.2f} | {g['hit@10_mean']:.2f} ± {g['hit@10_std']:.2f} | "
                     + ", ".join(f"{v:.2f}" for v in g["ndcg@10"]) + " |")
    if summary["dpformer_minus_transformer"]:
        lines += ["", "| dpformer − transformer-seqrec, same seed | ε | lr | B | epochs | NDCG@10 at the end | "
                  "largest gap over the evaluations |", "|---|---|---|---|---|---|---|"]
        for p in summary["dpformer_minus_transformer"]:
            lines.append(f"| seed {p['seed']} | {p['epsilon']:g} | {p['lr']:g} | {p['batch_size']} | {p['epochs']} | "
                         f"{p['ndcg@10_diff']:+.2f} | {p['max_abs_curve_diff']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path, help="reads DIR/runs/*.json, DIR/nonprivate/*.json and DIR/*.log")
    p.add_argument("--log-settings", nargs=4, metavar=("EPSILON", "LR", "BATCH_SIZE", "EPOCHS"),
                   help="settings of the runs that exist only as log lines in DIR/*.log")
    args = p.parse_args(argv)
    runs = [from_json(f) for f in sorted((args.dir / "runs").glob("*.json"))]
    runs += [from_json(f) for f in sorted((args.dir / "nonprivate").glob("*.json"))]
    logs = sorted(args.dir.glob("*.log"))
    if logs and not args.log_settings:
        raise SystemExit(f"{args.dir} has log files {[f.name for f in logs]}: give their --log-settings")
    for f in logs:
        eps, lr, bs, epochs = args.log_settings
        runs += from_log(f, float(eps), float(lr), int(bs), int(epochs))
    if not runs:
        raise SystemExit(f"no runs under {args.dir}/runs or {args.dir}/nonprivate")
    summary = summarise(runs)
    (args.dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    text = markdown(summary)
    (args.dir / "summary.md").write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
