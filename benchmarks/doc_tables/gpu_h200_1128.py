"""docs/RESULTS.md's H200 tables of 2026-11-28 (benchmarks/results/gpu_h200_1128): today's code in
bf16 and fp32 against the cost model's predictions made before it ran, and the dense norms over
runs of 1,024 entries that the profile of that call led to (GPT-2 T128, ViT-B/16 and the llama in
the same session; GPT-2 T512, T1024 and ResNet-50-GN in the next, ``head_ae809ef/``)."""

from __future__ import annotations

import json
from pathlib import Path

from doc_tables import figures, table
from doc_tables.gpu import load, one_config, ratio, time_memory
from doc_tables.gpu_model import LABELS, PREDICTED_163F862, TARGET_FIGURES
from doc_tables.prose import fixed, numbers_in

DIR = "benchmarks/results/gpu_h200_1128"
RUN = DIR + "/{precision}_{config}.json"
RUNS_1024 = DIR + "/dense_runs/bf16_{config}.json"
HEAD = DIR + "/head_ae809ef/{precision}_{config}.json"  # the next session's call: library ae809ef
CONFIGS = ["gpt2-small-t128", "gpt2-small-t512", "gpt2-small-t1024", "vit-base-patch16@224", "resnet50-gn-bias@224",
           "llama-bias-1b-t512"]  # fmt: skip
FP32 = ["gpt2-small-t128", "vit-base-patch16@224", "resnet50-gn-bias@224"]
RERUN = ["gpt2-small-t128", "vit-base-patch16@224", "llama-bias-1b-t512"]
HEAD_BF16 = ["gpt2-small-t512", "gpt2-small-t1024", "resnet50-gn-bias@224"]
HEAD_FP32 = ["resnet50-gn-bias@224"]
PREDICTED = ["gpt2-small-t128", "gpt2-small-t512", "vit-base-patch16@224", "resnet50-gn-bias@224", "llama-bias-1b-t512"]
COMMAND = "bash tools/gpu_checks.sh"
FILES = (
    [RUN.format(precision="bf16", config=c) for c in CONFIGS]
    + [RUN.format(precision="fp32", config=c) for c in FP32]
    + [RUNS_1024.format(config=c) for c in RERUN]
    + [HEAD.format(precision="bf16", config=c) for c in HEAD_BF16]
    + [HEAD.format(precision="fp32", config=c) for c in HEAD_FP32]
)
PREDICTED_FILES = [PREDICTED_163F862.format(config=c) for c in PREDICTED]
PROFILE = DIR + "/profile_gpt2-small-t128_bf16.json"
HEAD_PROFILES = [DIR + f"/head_ae809ef/profile_{c}_bf16.json" for c in ("gpt2-small-t128", "llama-bias-1b-t512")]
DENSE_RUNS = DIR + "/dense_runs/dense_norm_runs.json"


def _predicted(root: Path, config: str, mode: str, second: bool = False) -> str:
    if config not in PREDICTED:
        return "not predicted"
    modes = load(root, PREDICTED_163F862.format(config=config))["modes"]
    base = modes["nonprivate-bias" if second else "nonprivate-full"]
    return ratio(modes[mode]["h200_ms"] / base["h200_ms"])


def _entry(root: Path, path: str) -> dict | None:
    return one_config(load(root, path)) if (root / path).exists() else None


def _runs_1024(root: Path, config: str) -> dict | None:
    """The bf16 run at runs of 1,024 entries: the same session's call 3, or the next session's."""
    if config in RERUN:
        return _entry(root, RUNS_1024.format(config=config))
    return _entry(root, HEAD.format(precision="bf16", config=config)) if config in HEAD_BF16 else None


def _bitfit(entry: dict | None) -> str:
    return ratio(entry["time"]["modes"]["dpzoo-bitfit"]["time_ratio_second"]["median"]) if entry else "not run"


@table("gpu-h200-1128", files=FILES + PREDICTED_FILES, command=COMMAND)
def h200_1128(root: Path) -> str:
    lines = [
        "| config | non-private bf16 (ms) | bk-mixopt bf16: time / memory | time predicted before (163f862) "
        "| bk-mixopt bf16, runs of 1,024 | DP-BiTFiT bf16 of bias-only: measured / predicted / runs of 1,024 "
        "| fp32: non-private (ms), bk-mixopt time / memory; runs of 1,024 |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for config in CONFIGS:
        bf16 = one_config(load(root, RUN.format(precision="bf16", config=config)))
        rerun = _runs_1024(root, config)
        fp32 = one_config(load(root, RUN.format(precision="fp32", config=config))) if config in FP32 else None
        fp32_1024 = _entry(root, HEAD.format(precision="fp32", config=config)) if config in HEAD_FP32 else None
        cells = [
            LABELS[config],
            f"{bf16['time']['modes']['nonprivate-full']['median_ms']:.1f}",
            time_memory(bf16, "dpzoo-bk-mixopt"),
            _predicted(root, config, "dpzoo-bk-mixopt"),
            time_memory(rerun, "dpzoo-bk-mixopt") if rerun else "not run",
            f"{_bitfit(bf16)} / {_predicted(root, config, 'dpzoo-bitfit', second=True)} / {_bitfit(rerun)}",
            (
                f"{fp32['time']['modes']['nonprivate-full']['median_ms']:.1f}, {time_memory(fp32, 'dpzoo-bk-mixopt')}"
                + (f"; {time_memory(fp32_1024, 'dpzoo-bk-mixopt')}" if fp32_1024 else "")
            )
            if fp32
            else "not run",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _run_values(root: Path, path: str) -> list[float]:
    """A benchmark run's step times (ms), time ratios (median, low, high; to the second baseline) and memory ratios."""
    entry = one_config(load(root, path))
    values = []
    for m in entry["time"]["modes"].values():
        values += [m["median_ms"], m["time_ratio"]["median"], m["time_ratio"]["low"], m["time_ratio"]["high"]]
        values += [m["time_ratio_second"]["median"]] if "time_ratio_second" in m else []
    return values + [m["ratio"] for m in entry.get("memory", {}).values() if "ratio" in m]


@figures("gpu-h200-1128", files=FILES + PREDICTED_FILES + [PROFILE, DENSE_RUNS] + HEAD_PROFILES, command=COMMAND)
def h200_1128_figures(root: Path) -> set[str]:
    """The runs' times (ms) and ratios, the predictions' ratios, the profile's ms, the runs' TB/s."""
    values = []
    for path in FILES:
        values += _run_values(root, path)
    for path in PREDICTED_FILES:
        modes = load(root, path)["modes"]
        for b in ("nonprivate-full", "nonprivate-bias"):
            values += [modes[m][key] / modes[b][key] for m in modes for key in ("h200_ms", "peak_mb")]
    for path in [PROFILE] + HEAD_PROFILES:
        values += numbers_in(load(root, path)["modes"])  # step, phase, operator and kernel ms
    runs = load(root, DENSE_RUNS)["rows"]
    values += [r["ms"] for r in runs] + [r["read_TB_per_s"] for r in runs]
    return fixed(values, 0, 1, 2) | {f"{r['k']:,}" for r in runs} | TARGET_FIGURES


TODAY = DIR + "/head_95928c5/{precision}_{config}.json"  # the next session's second call: library 95928c5
TODAY_BF16 = ["gpt2-small-t128", "vit-base-patch16@224", "llama-bias-1b-t512"]
TODAY_FILES = [TODAY.format(precision="bf16", config=c) for c in TODAY_BF16] + [
    TODAY.format(precision="fp32", config="gpt2-small-t128")
]
TODAY_PROFILES = [DIR + f"/head_95928c5/profile_{c}_bf16.json" for c in ("gpt2-small-t128", "llama-bias-1b-t512")]


def call_table(root: Path, pattern: str, configs: list[str]) -> str:
    """One device call's bf16 table (``pattern`` with {precision} and {config}): the planner's plan,
    every layer forced onto each path, DP-BiTFiT, and fp32 where the call ran it."""
    lines = [
        "| config (bf16) | non-private (ms) | bk-mixopt: time / memory | every layer ghost | every layer instantiated "
        "| DP-BiTFiT of bias-only | fp32 bk-mixopt |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for config in configs:
        entry = one_config(load(root, pattern.format(precision="bf16", config=config)))
        fp32 = _entry(root, pattern.format(precision="fp32", config=config))
        modes = entry["time"]["modes"]
        cells = [
            LABELS[config],
            f"{modes['nonprivate-full']['median_ms']:.1f}",
            time_memory(entry, "dpzoo-bk-mixopt"),
            time_memory(entry, "dpzoo-bk") if "dpzoo-bk" in modes else "not run",
            time_memory(entry, "dpzoo-instantiate") if "dpzoo-instantiate" in modes else "not run",
            _bitfit(entry),
            time_memory(fp32, "dpzoo-bk-mixopt") if fp32 else "not run",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_values(root: Path, path: str) -> list[float]:
    """A benchmark run's step times (ms), time ratios (median, low, high; to the second baseline) and memory ratios."""
    return _run_values(root, path)


@table("gpu-h200-1128-today", files=TODAY_FILES, command=COMMAND)
def h200_1128_today(root: Path) -> str:
    return call_table(root, TODAY, TODAY_BF16)


LLAMA_PREDICTED = "benchmarks/results/cost/timed_plan/llama-bias-1b-t512.json"
PLAN_CHOICES = DIR + "/head_95928c5/plan_choices_gpt2-small-t128.jsonl"


@figures(
    "gpu-h200-1128-today",
    files=TODAY_FILES + TODAY_PROFILES + [LLAMA_PREDICTED, PLAN_CHOICES, RUNS_1024.format(config="llama-bias-1b-t512")],
    command=COMMAND,
)
def h200_1128_today_figures(root: Path) -> set[str]:
    """The call's times and ratios, its profiles' numbers (the kernels: kernel_ms less the phases'
    device ranges, which that call's kernel_ms counted too), the llama's predicted DP-BiTFiT ratio."""
    values = []
    for path in TODAY_PROFILES:
        for m in load(root, path)["modes"]:
            values.append(m["kernel_ms"] - sum(m["phases_ms"].values()))
    modes = load(root, LLAMA_PREDICTED)["modes"]
    values.append(modes["dpzoo-bitfit"]["h200_ms"] / modes["nonprivate-bias"]["h200_ms"])
    for path in TODAY_FILES:
        values += _run_values(root, path)
    for path in TODAY_PROFILES:
        values += numbers_in(load(root, path)["modes"])
    for line in (root / PLAN_CHOICES).read_text().splitlines():  # the planner's timings, one JSON per plan
        rows = json.loads(line)["timed_rows"]
        values += [r["ghost_ms"] for r in rows] + [r["instantiate_ms"] for r in rows]
    before = one_config(load(root, RUNS_1024.format(config="llama-bias-1b-t512")))  # the call before the hooks
    values.append(before["time"]["modes"]["dpzoo-bitfit"]["time_ratio_second"]["median"])
    return fixed(values, 0, 1, 2) | TARGET_FIGURES
