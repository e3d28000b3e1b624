"""docs/RESULTS.md's H200 tables of 2026-11-27 (benchmarks/results/gpu_h200_1127): the step cost of
the code the cost model is calibrated on, and the planner timing its choices on CUDA against the
multiply-add model, each configuration's two runs on one machine."""

from __future__ import annotations

import re
from pathlib import Path

from doc_tables import figures, table
from doc_tables.gpu import load, one_config, ratio, status, time_memory
from doc_tables.gpu_model import LABELS, TARGET_FIGURES
from doc_tables.prose import fixed

DIR = "benchmarks/results/gpu_h200_1127"
RUN = DIR + "/bf16_{config}.json"
CONFIGS = ["gpt2-small-t128", "gpt2-small-t512", "vit-base-patch16@224", "resnet50-gn-bias@224", "llama-bias-1b-t512"]
H100_NOW = "benchmarks/results/gpu_h100_1126/bf16_{config}.json"
H100_NAMES = {c: c.replace("@", "_") for c in CONFIGS}
TIMED = DIR + "/timed_plans/{variant}_{config}.json"
TIMED_CONFIGS = ["gpt2-small-t128", "vit-base-patch16@224", "resnet50-gn-bias@224", "llama-bias-1b-t512"]
COMMAND = "bench_training_step.py --device cuda --rounds 5 --steps 2 --warmup 2 --threads 8 --precision bf16"
FILES = [RUN.format(config=c) for c in CONFIGS] + [H100_NOW.format(config=H100_NAMES[c]) for c in CONFIGS]
TIMED_FILES = [TIMED.format(variant=v, config=c) for c in TIMED_CONFIGS for v in ("base", "new")]
OOM_LOG = DIR + "/timed_plans/device_log_ab.txt"  # the timed ResNet-50 run that ran out of memory


@table("gpu-h200-1127", files=FILES, command=COMMAND)
def h200_1127(root: Path) -> str:
    lines = [
        "| config (bf16) | non-private (ms) | dpzoo bk-mixopt | dpzoo instantiate | DP-BiTFiT (of bias-only) "
        "| bk-mixopt on the H100 (11-26) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for config in CONFIGS:
        entry = one_config(load(root, RUN.format(config=config)))
        before = one_config(load(root, H100_NOW.format(config=H100_NAMES[config])))["time"]["modes"]
        cells = [
            LABELS[config],
            f"{entry['time']['modes']['nonprivate-full']['median_ms']:.1f}",
            time_memory(entry, "dpzoo-bk-mixopt"),  # "not run" where the mode did not run
            time_memory(entry, "dpzoo-instantiate"),
            time_memory(entry, "dpzoo-bitfit", second=True),
            ratio(before["dpzoo-bk-mixopt"]["time_ratio"]["median"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ms_ratio(modes: dict, mode: str) -> str:
    m = modes.get(mode)
    return status(m) or f"{m['median_ms']:.1f} ms ({ratio(m['time_ratio']['median'])})"


@table("gpu-h200-timed-plans", files=TIMED_FILES, command="PYTHONPATH=/tmp/site:.base")
def timed_plans(root: Path) -> str:
    lines = [
        "| config (bf16) | bk-mixopt, the model's plan (2bb3e0b) | bk-mixopt, timed plan | instantiate everywhere "
        "| peak memory, timed plan (its first step, which times) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for config in TIMED_CONFIGS:
        base = one_config(load(root, TIMED.format(variant="base", config=config)))
        new = one_config(load(root, TIMED.format(variant="new", config=config)))
        memory = new.get("memory", {})
        cells = [
            LABELS[config],
            _ms_ratio(base["time"]["modes"], "dpzoo-bk-mixopt"),
            _ms_ratio(new["time"]["modes"], "dpzoo-bk-mixopt"),
            _ms_ratio(new["time"]["modes"], "dpzoo-instantiate"),
            _memory(memory),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _memory(memory: dict) -> str:
    """``2.16× (3.44×)``: the steps' peak, then the first step's, each over non-private's."""
    m, base = memory.get("dpzoo-bk-mixopt"), memory.get("nonprivate-full")
    if not m or "ratio" not in m:
        return "not measured"
    return f"{ratio(m['ratio'])} ({ratio(m['first_step_mb'] / base['first_step_mb'])})"


@figures("gpu-h200-1127", files=FILES + TIMED_FILES + [OOM_LOG], command="bench_training_step.py --device cuda")
def h200_1127_figures(root: Path) -> set[str]:
    """The runs' step times (ms), time ratios and memory ratios, the failed allocation's GiB, the targets."""
    asked = re.findall(r"Tried to allocate ([\d.]+) GiB", (root / OOM_LOG).read_text())
    values = []
    for path in FILES + TIMED_FILES:
        entry = one_config(load(root, path))
        values += [v for m in entry["time"]["modes"].values() if m["status"] == "ok"
                   for v in (m["median_ms"], m["time_ratio"]["median"], m["time_ratio"]["low"], m["time_ratio"]["high"])]  # fmt: skip
        memory = entry.get("memory", {})
        values += [m["ratio"] for m in memory.values() if "ratio" in m]
        if "nonprivate-full" in memory:  # first-step peaks over non-private's
            values += [m["first_step_mb"] / memory["nonprivate-full"]["first_step_mb"] for m in memory.values()]
    return fixed(values, 0, 1) | fixed(values, 1, 2) | fixed(map(float, asked), 0) | TARGET_FIGURES
