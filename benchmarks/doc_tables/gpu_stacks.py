"""docs/RESULTS.md's table of the stacked ghost path (2026-11-28, no GPU lent): the cost model's
predictions for the H200 before (3c8895c) and after the change, from traced steps
(``benchmarks/results/cost/predicted_stacks/``), beside what the H200 measured of the code before."""

from __future__ import annotations

from pathlib import Path

from doc_tables import figures, table
from doc_tables.gpu import load, one_config, ratio
from doc_tables.gpu_model import LABELS

DIR = "benchmarks/results/cost/predicted_stacks"
AFTER = DIR + "/{config}.json"
BEFORE = DIR + "/before_3c8895c/{config}.json"
MEASURED = {  # the H200's runs of the code before (library 95928c5 / ae809ef): bf16
    "gpt2-small-t128": "benchmarks/results/gpu_h200_1128/head_95928c5/bf16_gpt2-small-t128.json",
    "gpt2-small-t512": "benchmarks/results/gpu_h200_1128/head_ae809ef/bf16_gpt2-small-t512.json",
    "vit-base-patch16@224": "benchmarks/results/gpu_h200_1128/head_95928c5/bf16_vit-base-patch16@224.json",
    "llama-bias-1b-t512": "benchmarks/results/gpu_h200_1128/head_95928c5/bf16_llama-bias-1b-t512.json",
}
ROWS = [
    ("gpt2-small-t128", "dpzoo-bk"),
    ("gpt2-small-t128", "dpzoo-bk-mixopt"),
    ("gpt2-small-t512", "dpzoo-bk"),
    ("gpt2-small-t512", "dpzoo-bk-mixopt"),
    ("vit-base-patch16@224", "dpzoo-bk"),
    ("vit-base-patch16@224", "dpzoo-bk-mixopt"),
    ("llama-bias-1b-t512", "dpzoo-bitfit"),
]
MODE_LABELS = {"dpzoo-bk": "every use ghost (bk)", "dpzoo-bk-mixopt": "bk-mixopt, timed plan",
               "dpzoo-bitfit": "DP-BiTFiT (of bias-only)"}  # fmt: skip
CONFIGS = sorted({c for c, _ in ROWS})
FILES = [AFTER.format(config=c) for c in CONFIGS] + [BEFORE.format(config=c) for c in CONFIGS] + list(MEASURED.values())
COMMAND = "python benchmarks/cost_predict.py"


def _predicted(root: Path, path: str, mode: str) -> dict:
    """Operators, milliseconds, the ratio to the file's baseline (its first mode) and peak MB."""
    modes = load(root, path)["modes"]
    base = next(iter(modes.values()))
    row = modes[mode]
    return {"ops": row["ops"], "ms": row["h200_ms"], "ratio": row["h200_ms"] / base["h200_ms"], "mb": row["peak_mb"]}


def _measured(root: Path, config: str, mode: str) -> str:
    entry = one_config(load(root, MEASURED[config]))
    t = entry["time"]["modes"].get(mode)
    if t is None:
        return "not run"
    return ratio(t["time_ratio_second" if mode == "dpzoo-bitfit" else "time_ratio"]["median"])


def _rows(root: Path):
    for config, mode in ROWS:
        before = _predicted(root, BEFORE.format(config=config), mode)
        after = _predicted(root, AFTER.format(config=config), mode)
        yield config, mode, before, after


@table("gpu-stacks-predicted", files=FILES, command=COMMAND)
def stacks_predicted(root: Path) -> str:
    lines = [
        "| config | mode | operators: before → after | predicted H200 ms: before → after "
        "| predicted ratio: before → after | predicted peak MB: before → after | measured before (H200) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for config, mode, before, after in _rows(root):
        lines.append(
            f"| {LABELS[config]} | {MODE_LABELS[mode]} | {before['ops']:,} → {after['ops']:,} "
            f"| {before['ms']:.1f} → {after['ms']:.1f} | {ratio(before['ratio'])} → {ratio(after['ratio'])} "
            f"| {before['mb']:,.0f} → {after['mb']:,.0f} | {_measured(root, config, mode)} |"
        )
    return "\n".join(lines)


@figures("gpu-stacks-predicted", files=FILES, command=COMMAND)
def stacks_figures(root: Path):
    for config, mode, before, after in _rows(root):
        yield from (str(before["ops"]), str(after["ops"]), f"{before['ms']:.1f}", f"{after['ms']:.1f}")
        yield from (f"{before['ratio']:.2f}", f"{after['ratio']:.2f}", f"{after['mb'] / before['mb']:.2f}")
        yield _measured(root, config, mode).rstrip("×")
