"""docs/RESULTS.md's audit tables: the one-run audit of dpzoo's engine and its two positive
controls, from the JSON of ``benchmarks/audit_sweep.py`` (one file per claimed ε)."""

from __future__ import annotations

import json
from pathlib import Path

from doc_tables import table

FILE = "benchmarks/results/audit/audit_eps{eps:g}.json"
EPSILONS = (2, 4, 8)
NAMES = {None: "dpzoo engine", "no-noise": "no-noise (σ = 0, claiming the engine's σ)", "unclipped": "unclipped"}


def runs(root: Path, eps: float) -> list[dict]:
    return json.loads((root / FILE.format(eps=eps)).read_text())["runs"]


def verdict(r: dict) -> str:
    return "exceeds (exit 1)" if r["exceeds"] else "consistent (exit 0)"


@table("audit-seed0", files=[FILE.format(eps=2)], command="python benchmarks/audit_sweep.py --epsilon 2")
def seed0(root: Path) -> str:
    lines = [
        "| mechanism | claimed ε (δ = 1e-5) | lower bound ε | confidence | m | in | r | v | verdict | audit s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in (r for r in runs(root, 2) if r["seed"] == 0):
        lines.append(
            f"| {NAMES[r['broken']]} | {r['claimed_epsilon']:.3f} | {r['epsilon_lower_bound']:.3f} | "
            f"{100 * r['confidence']:g}% | {r['canaries']} | {r['included']} | {r['guesses']} | {r['correct']} | "
            f"{verdict(r)} | {r['seconds']:.1f} |"
        )
    return "\n".join(lines)


def span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.2f}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}–{hi:.2f}"


@table(
    "audit-sweep",
    files=[FILE.format(eps=e) for e in EPSILONS],
    command="python benchmarks/audit_sweep.py --epsilon 4 --seeds 0 1 2",
)
def sweep(root: Path) -> str:
    """Per claimed ε: the lower bounds over seeds (min–max) of each mechanism, the engine's σ and
    test accuracy, and the most the audit could show."""
    lines = [
        "| claimed ε | σ | seeds | engine: bound | no-noise: bound | unclipped: bound | engine test accuracy "
        "| most the audit can show |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for eps in EPSILONS:
        rs = runs(root, eps)
        of = {b: [r for r in rs if r["broken"] == b] for b in NAMES}
        engine = of[None]
        cells = [
            f"{engine[0]['claimed_epsilon']:.2f}",
            f"{engine[0]['mechanism']['noise_multiplier']:.3f}",
            str(len(engine)),
            *(span([r["epsilon_lower_bound"] for r in of[b]]) for b in NAMES),
            span([r["test_accuracy"] for r in engine]),
            f"{engine[0]['max_auditable_epsilon']:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


WHITE_NAMES = {
    None: "dpzoo engine",
    "no-noise": "no-noise (σ = 0)",
    "sensitivity-2x": "sensitivity 2× (clips at 2R, noise σR)",
    "sensitivity-1.5x": "sensitivity 1.5×",
    "half-noise": "half the noise (σ/2)",
}


WHITE_FILES = {2: ("", "_m1000", "_m5000"), 8: ("",)}


def white_file(eps: int, suffix: str) -> str:
    return f"benchmarks/results/audit/white_box_eps{eps}{suffix}.json"


def _estimator(r: dict, name: str) -> float:
    return r["estimators"][name]["epsilon_lower_bound"]


@table(
    "audit-white-box",
    files=[white_file(e, s) for e, suffixes in WHITE_FILES.items() for s in suffixes],
    command="python benchmarks/audit_sweep.py --threat-model white-box --epsilon 2",
)
def white_box(root: Path) -> str:
    """Per claimed ε, canary count and mechanism: each estimator's bounds over seeds, the reported
    (larger) one, and how many runs exceed the claim."""
    lines = [
        "| mechanism | claimed ε | canaries | seeds | one-run ε (min–max) | Gaussian DP ε (min–max) "
        "| runs above the claim | s per run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for eps, suffixes in WHITE_FILES.items():
        for suffix in suffixes:
            rs = json.loads((root / white_file(eps, suffix)).read_text())["runs"]
            for broken, name in WHITE_NAMES.items():
                mine = [r for r in rs if r["broken"] == broken]
                if not mine:
                    continue
                seconds = sum(r["seconds"] for r in mine) / len(mine)
                lines.append(
                    f"| {name} | {mine[0]['claimed_epsilon']:.2f} | {mine[0]['canaries']} | {len(mine)} | "
                    f"{span([_estimator(r, 'one-run') for r in mine])} | {span([_estimator(r, 'gdp') for r in mine])} "
                    f"| {sum(r['exceeds'] for r in mine)} of {len(mine)} | {seconds:.0f} |"
                )
    return "\n".join(lines)
