"""docs/RESULTS.md's user-level DP table: MovieLens-1M users, user-level sampling against
example-level sampling at the same user-level ε, from ``examples/user_level_movielens.py``'s
``results.json``, and the figures of the section's prose."""

from __future__ import annotations

import json
from pathlib import Path

from doc_tables import figures, table
from doc_tables.prose import fixed

FILE = "benchmarks/results/user_level_movielens/results.json"
COMMAND = "examples/user_level_movielens.py --out benchmarks/results/user_level_movielens"
LABELS = {
    "non-private": "non-private",
    "uls": "user-level sampling (per-user clipping)",
    "els": "example-level sampling, k per user kept",
    "example": "example-level DP (ε per rating, not per user)",
}


def load(root: Path) -> dict:
    return json.loads((root / FILE).read_text())


def _eps(r: dict) -> str:
    return "–" if r["epsilon"] is None else f"{r['epsilon']:g}"


@table("user-level-movielens", files=[FILE], command=COMMAND)
def results_table(root: Path) -> str:
    lines = [
        "| method | k | ε | test accuracy | log-loss | σ | steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in load(root)["results"]:
        sigma = "–" if "noise_multiplier" not in r else f"{r['noise_multiplier']:.3g}"
        steps = "–" if "steps" not in r else str(r["steps"])
        k = "–" if r["k"] is None else str(r["k"])
        lines.append(
            f"| {LABELS[r['method']]} | {k} | {_eps(r)} | {r['accuracy']:.3f} | {r['log_loss']:.3f} | {sigma} | {steps} |"
        )
    return "\n".join(lines)


@figures("user-level-movielens", files=[FILE], command=COMMAND)
def results_figures(root: Path) -> set[str]:
    """Accuracies and log-losses (3 decimals, and accuracies in %), ratings per user, the liked
    rate, and the runs' seconds and minutes."""
    out = load(root)
    data, rs = out["data"], out["results"]
    found = fixed([r["accuracy"] for r in rs], 3) | fixed([r["accuracy"] for r in rs], 1, scale=100)
    found |= fixed([r["log_loss"] for r in rs], 3) | fixed([data["liked_rate_test"]], 1, scale=100)
    found |= fixed([r["seconds"] for r in rs], 0) | fixed([r["seconds"] for r in rs], 1, scale=1 / 60)
    found |= fixed([data["ratings_per_user"]["median"]], 0)
    pairs = [(a, b) for a in rs for b in rs if a is not b]
    found |= fixed([100 * (a["accuracy"] - b["accuracy"]) for a, b in pairs], 1)  # differences in points
    return found
