"""docs/RESULTS.md's MiniLM tables: DP-LoRA, DP-BiTFiT, DP-FROST and full DP fine-tuning at the same
(ε, δ), from the ``results.json`` files of ``examples/dp_finetune_minilm_compare.py``, and the
figures of the section's prose."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from doc_tables import figures, table
from doc_tables.prose import fixed

DIR = "benchmarks/results/minilm"
RUNS = {  # folder -> the command that wrote it (its options after the script name)
    "main": "--seeds 0 1 2 --out benchmarks/results/minilm/main",
    "lora_bitfit": "--methods dp-lora-bitfit --lr dp-lora-bitfit=5e-3",
    "lora_lr5e-3": "--methods dp-lora --lr dp-lora=5e-3",
    "lora_lr2e-2": "--methods dp-lora --lr dp-lora=2e-2",
}
FILES = [f"{DIR}/{run}/results.json" for run in RUNS]
LABELS = {
    "dp-lora": "DP-LoRA (r = 8, α = 16; query, value; + head)",
    "dp-bitfit": "DP-BiTFiT (biases + head)",
    "dp-frost": "DP-FROST (γ = 0.25, + head)",
    "full": "full DP (BK-MixOpt)",
    "dp-lora-bitfit": 'DP-LoRA + DP-BiTFiT (`dp_lora(..., bias="all")`)',
}


def rows(root: Path, run: str) -> list[dict]:
    return json.loads((root / DIR / run / "results.json").read_text())["results"]


def by_method(root: Path) -> dict[str, list[dict]]:
    """Each method's runs (seed order): the four of the main run, then LoRA + DP-BiTFiT."""
    out: dict[str, list[dict]] = {}
    for r in rows(root, "main") + rows(root, "lora_bitfit"):
        out.setdefault(r["method"], []).append(r)
    return {m: sorted(rs, key=lambda r: r["seed"]) for m, rs in out.items()}


def parameters(rs: list[dict]) -> str:
    counts = sorted({r["trainable_parameters"] for r in rs})
    text = f"{counts[0]:,}" if len(counts) == 1 else f"{counts[0]:,}–{counts[-1]:,}"
    return text


def accuracies(rs: list[dict]) -> str:
    return " / ".join(f"{r['accuracy']:.3f}" for r in rs)


@table("minilm-methods", files=FILES[:2], command=RUNS["main"])
def methods(root: Path) -> str:
    lines = [
        "| method | trainable parameters | lr | test accuracy, seeds 0 / 1 / 2 | mean | ε | training s per run |",
        "|---|---|---|---|---|---|---|",
    ]
    for method, rs in by_method(root).items():
        mean = statistics.mean(r["accuracy"] for r in rs)
        seconds = statistics.mean(r["train_seconds"] for r in rs)
        eps = max(r["epsilon"] for r in rs)
        lines.append(
            f"| {LABELS[method]} | {parameters(rs)} | {rs[0]['lr']:g} | {accuracies(rs)} | {mean:.3f} | "
            f"{eps:.2f} | {seconds:.0f} |"
        )
    return "\n".join(lines)


@table("minilm-lora-lr", files=[FILES[0], FILES[2], FILES[3]], command=RUNS["lora_lr5e-3"])
def lora_learning_rate(root: Path) -> str:
    lines = ["| DP-LoRA lr | test accuracy, seeds 0 / 1 / 2 | mean |", "|---|---|---|"]
    runs = [rows(root, "lora_lr5e-3"), [r for r in rows(root, "main") if r["method"] == "dp-lora"]]
    runs.append(rows(root, "lora_lr2e-2"))
    for rs in runs:
        rs = sorted(rs, key=lambda r: r["seed"])
        mean = statistics.mean(r["accuracy"] for r in rs)
        lines.append(f"| {rs[0]['lr']:g} | {accuracies(rs)} | {mean:.3f} |")
    return "\n".join(lines)


@table("minilm-frost-selection", files=FILES[:1], command=RUNS["main"])
def frost_selection(root: Path) -> str:
    """DP-FROST's private selection per seed: what it picked, what it measured, what it cost."""
    lines = [
        "| seed | partitions picked (of) | examples measured | σ_ps | σ_SGD | selection s | training s per epoch |",
        "|---|---|---|---|---|---|---|",
    ]
    settings = json.loads((root / DIR / "main" / "results.json").read_text())["settings"]
    for r in by_method(root)["dp-frost"]:
        per_epoch = r["train_seconds"] / settings["epochs"]
        lines.append(
            f"| {r['seed']} | {len(r['selected'])} ({r['partitions']}) | {r['selection_samples']} | "
            f"{r['selection_noise_multiplier']:.3f} | {r['noise_multiplier']:.3f} | {r['setup_seconds']:.1f} | "
            f"{per_epoch:.1f} |"
        )
    return "\n".join(lines)


DATA = f"{DIR}/main/data.json"
# The DP-FROST paper's settings the section states (Algorithm 1's ComputeSigma gives DP-SGD 0.9·ε;
# γ = 0.25 and q_ps = 0.02 are the selection's settings in examples/dp_finetune_minilm_compare.py).
SETTINGS = {"0.9", "0.25", "0.02"}


def two_figures(x: float) -> str:
    """``x`` to two significant figures, as prose rounds a ratio (200.6 → '200')."""
    return f"{float(f'{x:.2g}'):g}"


@figures("minilm", files=FILES + [DATA], command=RUNS["main"])
def minilm_figures(root: Path) -> set[str]:
    """Means, spreads and sizes the prose states, from the same runs as the tables."""
    runs = by_method(root)
    means = {m: statistics.mean(r["accuracy"] for r in rs) for m, rs in runs.items()}
    full = [r["accuracy"] for r in runs["full"]]
    lora_means = [statistics.mean(r["accuracy"] for r in rows(root, run)) for run in ("lora_lr5e-3", "lora_lr2e-2")]
    size = {m: rs[0]["trainable_parameters"] for m, rs in runs.items()}
    frost = runs["dp-frost"][0]
    data = json.loads((root / DATA).read_text())
    found = fixed(means.values(), 2, 3) | fixed(lora_means + [means["dp-lora"]], 3)
    found |= fixed([max(means.values()) - min(means.values()), max(full) - min(full)], 0, 1, scale=100)
    found |= fixed([size["dp-lora"] / size["full"]], 2, scale=100) | fixed([size["full"] / 1e6], 1)
    found |= {
        two_figures(frost["trainable_parameters"] / size["dp-bitfit"]),
        two_figures(runs["dp-bitfit"][0]["lr"] / frost["lr"]),
    }
    picked = [len(r["selected"]) for r in runs["dp-frost"]]  # DP-FROST's partitions, per seed
    found |= fixed([min(picked), max(picked)], 0)
    return found | fixed([max(data["test_class_counts"]) / data["test"]], 1, scale=100) | SETTINGS
