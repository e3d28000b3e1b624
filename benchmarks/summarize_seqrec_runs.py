"""Summarise sequential-recommendation runs: one row per (model, ε, lr, B), mean ± std over seeds.

Reads run JSONs (what ``reproduce_dpformer_ml1m.py`` and ``train_seqrec`` write) and, for runs
whose JSON was lost, the evaluation lines they printed (test metrics only), tagged either
``[MODEL_epsE_lrLR_bsB_seedS]`` (``reproduce_dpformer_ml1m.py --verbose``; settings in the tag)
or ``[MODEL sSEED]`` (a ``train_seqrec(log=...)`` callback; settings from ``--log-settings``).
A run given twice (file and log) is an error, not counted twice.
``--also DIR2`` adds DIR2/runs/*.json (each run's device is kept in the summary).
Also writes the per-seed difference dpformer − transformer-seqrec where both ran with the same
seed and settings (same seed: the same initialisation; the same Poisson batches and noise draws
only for runs given noise and sample seeds, which are secret by default since the engine's
privacy fixes).

    python benchmarks/summarize_seqrec_runs.py benchmarks/results/dpformer_ml1m/gpu100 \\
        --log-settings 20 0.01 1024 --log-epochs 100
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

# Two tags: "[MODEL sSEED]" (a hand-made log= callback; settings from --log-settings) and
# "[MODEL_epsE_lrLR_bsB_seedS]" (reproduce_dpformer_ml1m.py --verbose; settings in the tag).
LINE = re.compile(
    r"^\[(?P<model>[\w-]+?)(?: s(?P<seed>\d+)|_eps(?P<eps>[\d.e+-]+)_lr(?P<lr>[\d.e+-]+)"
    r"_bs(?P<bs>\d+)_seed(?P<tseed>\d+))\] epoch (?P<epoch>\d+): test NDCG@10 (?P<ndcg>[\d.]+)%  "
    r"HIT@10 (?P<hit>[\d.]+)%"
)


def from_json(path: Path) -> dict:
    r = json.loads(path.read_text())
    last = r["history"][-1]
    return {
        "model": r["model"],
        "epsilon": r.get("epsilon_target"),
        "lr": r["lr"],
        "batch_size": r["batch_size"],
        "epochs": r["epochs"],
        "seed": r["seed"],
        "ndcg": 100 * last["test_ndcg@10"],
        "hit": 100 * last["test_hit@10"],
        "noise_multiplier": r.get("noise_multiplier"),
        "curve": [(h["epoch"], 100 * h["test_ndcg@10"]) for h in r["history"]],
        "source": path.name,
        "device": r.get("device"),
    }


def from_log(path: Path, settings: tuple | None, epochs: int | None) -> list[dict]:
    """Runs from printed evaluation lines. ``settings`` = (ε, lr, B) for "[MODEL sSEED]" tags;
    a run counts only if its last printed evaluation is epoch ``epochs`` (when given)."""
    curves = defaultdict(list)
    for line in path.read_text().splitlines():
        m = LINE.match(line)
        if not m:
            continue
        if m["seed"] is not None:
            if settings is None:
                raise SystemExit(f"{path}: '[{m['model']} s{m['seed']}]' lines carry no settings: give --log-settings")
            key = (m["model"], *settings, int(m["seed"]))
        else:
            key = (m["model"], float(m["eps"]), float(m["lr"]), int(m["bs"]), int(m["tseed"]))
        curves[key].append((int(m["epoch"]), float(m["ndcg"]), float(m["hit"])))
    runs = []
    for (model, eps, lr, bs, seed), rows in curves.items():
        rows.sort()
        if epochs is not None and rows[-1][0] != epochs:
            raise SystemExit(f"{path}: {model} ε={eps:g} seed {seed} stops at epoch {rows[-1][0]}, not {epochs}")
        runs.append(
            {
                "model": model,
                "epsilon": eps,
                "lr": lr,
                "batch_size": bs,
                "epochs": rows[-1][0],
                "seed": seed,
                "ndcg": rows[-1][1],
                "hit": rows[-1][2],
                "noise_multiplier": None,
                "curve": [(e, n) for e, n, _ in rows],
                "source": path.name,
            }
        )
    return runs


def summarise(runs: list[dict]) -> dict:
    groups, seen = defaultdict(list), {}
    for r in runs:
        key = (r["model"], r["epsilon"], r["lr"], r["batch_size"], r["epochs"], r["seed"])
        if key in seen:
            raise SystemExit(f"the same run twice: {key} in {seen[key]} and {r['source']}")
        seen[key] = r["source"]
        groups[key[:5]].append(r)
    rows = []
    for (model, eps, lr, bs, epochs), rs in sorted(
        groups.items(),
        key=lambda kv: (kv[0][1] if kv[0][1] is not None else float("inf"), kv[0][3], kv[0][2], kv[0][0]),
    ):
        rs.sort(key=lambda r: r["seed"])
        nd, hit = [r["ndcg"] for r in rs], [r["hit"] for r in rs]
        rows.append(
            {
                "model": model,
                "epsilon": eps,
                "lr": lr,
                "batch_size": bs,
                "epochs": epochs,
                "seeds": [r["seed"] for r in rs],
                "ndcg@10": nd,
                "hit@10": hit,
                "ndcg@10_mean": statistics.mean(nd),
                "ndcg@10_std": statistics.stdev(nd) if len(nd) > 1 else 0.0,
                "hit@10_mean": statistics.mean(hit),
                "hit@10_std": statistics.stdev(hit) if len(hit) > 1 else 0.0,
                "sources": [r["source"] for r in rs],
                "devices": [r.get("device") for r in rs],
            }
        )
    paired = []
    by_key = {(r["model"], r["epsilon"], r["lr"], r["batch_size"], r["epochs"], r["seed"]): r for r in runs}
    order = lambda kv: (kv[0][1] if kv[0][1] is not None else float("inf"), kv[0][3], kv[0][2], kv[0][5])
    for (model, *rest), r in sorted(by_key.items(), key=order):
        other = by_key.get(("transformer-seqrec", *rest))
        if model == "dpformer" and other is not None:
            a, b = dict(r["curve"]), dict(other["curve"])
            common = sorted(a.keys() & b.keys())  # compare the same epochs only
            paired.append(
                {
                    "epsilon": rest[0],
                    "lr": rest[1],
                    "batch_size": rest[2],
                    "epochs": rest[3],
                    "seed": rest[4],
                    "ndcg@10_diff": r["ndcg"] - other["ndcg"],
                    "compared_epochs": common,
                    "max_abs_curve_diff": max(abs(a[e] - b[e]) for e in common),
                }
            )
    return {"groups": rows, "dpformer_minus_transformer": paired}


def markdown(summary: dict) -> str:
    lines = [
        "| model | ε | lr | B | epochs | seeds | NDCG@10 (%) | HIT@10 (%) | per seed NDCG@10 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for g in summary["groups"]:
        eps = "non-private" if g["epsilon"] is None else f"{g['epsilon']:g}"
        lines.append(
            f"| {g['model']} | {eps} | {g['lr']:g} | {g['batch_size']} | {g['epochs']} | {len(g['seeds'])} | "
            f"{g['ndcg@10_mean']:.2f} ± {g['ndcg@10_std']:.2f} | {g['hit@10_mean']:.2f} ± {g['hit@10_std']:.2f} | "
            + ", ".join(f"{v:.2f}" for v in g["ndcg@10"])
            + " |"
        )
    if summary["dpformer_minus_transformer"]:
        lines += [
            "",
            "| dpformer − transformer-seqrec, same seed | ε | lr | B | epochs | NDCG@10 at the end | "
            "largest gap over the evaluations |",
            "|---|---|---|---|---|---|---|",
        ]
        for p in summary["dpformer_minus_transformer"]:
            eps = "non-private" if p["epsilon"] is None else f"{p['epsilon']:g}"
            lines.append(
                f"| seed {p['seed']} | {eps} | {p['lr']:g} | {p['batch_size']} | {p['epochs']} | "
                f"{p['ndcg@10_diff']:+.2f} | {p['max_abs_curve_diff']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path, help="reads DIR/runs/*.json, DIR/nonprivate/*.json and DIR/*.log")
    p.add_argument(
        "--also",
        type=Path,
        nargs="*",
        default=[],
        metavar="DIR",
        help="further folders whose runs/*.json count too (e.g. seed 0 run on another machine); "
        "the summary is still written to the first DIR",
    )
    p.add_argument(
        "--log-settings",
        nargs=3,
        metavar=("EPSILON", "LR", "BATCH_SIZE"),
        help="settings of '[MODEL sSEED]' log lines in DIR/*.log (the runner's own tags carry them)",
    )
    p.add_argument(
        "--log-epochs",
        type=int,
        default=None,
        help="count a logged run only if it reached this epoch (else stop with an error)",
    )
    args = p.parse_args(argv)
    runs = [from_json(f) for d in [args.dir, *args.also] for f in sorted((d / "runs").glob("*.json"))]
    runs += [from_json(f) for f in sorted((args.dir / "nonprivate").glob("*.json"))]
    settings = None
    if args.log_settings:
        eps, lr, bs = args.log_settings
        settings = (float(eps), float(lr), int(bs))
    for f in sorted(args.dir.glob("*.log")):
        runs += from_log(f, settings, args.log_epochs)
    if not runs:
        raise SystemExit(f"no runs under {args.dir}/runs or {args.dir}/nonprivate")
    summary = summarise(runs)
    (args.dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    text = markdown(summary)
    (args.dir / "summary.md").write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
