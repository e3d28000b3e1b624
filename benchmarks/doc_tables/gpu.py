"""Step-cost tables of ``benchmarks/bench_training_step.py`` JSON: docs/BENCHMARKS.md's CPU and H100
tables and docs/RESULTS.md's H200 table, and the figures of the H200 section's prose."""

from __future__ import annotations

import json
import re
from pathlib import Path

import table as step_table
from bench_modes import MODES  # benchmarks/table.py, the benchmark's own printer

from doc_tables import figures, table
from doc_tables.prose import fixed

CPU = "benchmarks/results/training_step.json"
H100 = {"fp32": "benchmarks/results/gpu/training_step.json", "bf16": "benchmarks/results/gpu/training_step_bf16.json"}
H200 = "benchmarks/results/gpu_h200/{precision}_{config}.json"
H200_ROWS = [  # (precision, config, label), in the table's order
    ("bf16", "gpt2-small-t128", "GPT-2 small T128 B32"),
    ("bf16", "gpt2-small-t512", "GPT-2 small T512 B32"),
    ("bf16", "gpt2-small-t1024", "GPT-2 small T1024 B32 (`--pairwise`)"),
    ("bf16", "vit-base-patch16@224", "ViT-B/16 224² B64"),
    ("bf16", "resnet50-gn-bias@224", "ResNet-50-GN 224² B64"),
    ("bf16", "llama-bias-1b-t512", "llama-bias 1.1B T512 B8"),
    ("fp32", "gpt2-small-t128", "GPT-2 small T128 B32"),
    ("fp32", "resnet50-gn-bias@224", "ResNet-50-GN 224² B64"),
]
H100_LABELS = {
    "gpt2-small-t128": "gpt2-small T128",
    "gpt2-small-t512": "gpt2-small T512",
    "vit-base-patch16@224": "vit-base-patch16",
    "resnet50-gn-bias@224": "resnet50-gn-bias",
    "llama-bias-1b-t512": "llama-bias ~1.1B T512",
}


def load(root: Path, path: str) -> dict:
    return json.loads((root / path).read_text())


def ratio(x: float) -> str:
    return f"{x:.2f}×"


def status(result: dict | None) -> str | None:
    """The cell of a mode that did not run: ``not run``, ``out of memory``, ``error (autocast)``…"""
    if result is None:
        return "not run"
    if result["status"] == "ok":
        return None
    if result["status"] == "oom":
        return "out of memory"
    if result["status"] == "unsupported" and "tied" in result.get("reason", ""):
        return "unsupported (tied)"
    if "BFloat16" in result.get("reason", ""):
        return "error (autocast)"
    return result["status"]


def time_memory(entry: dict, mode: str, second: bool = False) -> str:
    """``1.65× / 1.36×`` (time / memory ratio); with ``second`` the time against the second
    baseline in parentheses: ``1.10× (1.15×)``."""
    t = entry["time"]["modes"].get(mode)
    if status(t):
        return status(t)
    text = ratio(t["time_ratio"]["median"])
    if second:
        text += f" ({ratio(t['time_ratio_second']['median'])})"
    m = entry.get("memory", {}).get(mode)
    return text if m is None or "ratio" not in m else f"{text} / {ratio(m['ratio'])}"


def one_config(data: dict) -> dict:
    (entry,) = data["configs"].values()
    return entry


@table(
    "gpu-h200",
    files=[H200.format(precision=p, config=c) for p, c, _ in H200_ROWS] + list(H100.values()),
    command="bench_training_step.py --device cuda --rounds 5 --steps 2 --warmup 2",
)
def h200(root: Path) -> str:
    lines = [
        "| config | precision | non-private (ms) | dpzoo bk-mixopt | DP-BiTFiT (of bias-only) | Opacus hooks "
        "| H100 bk-mixopt (11-24) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for precision, config, label in H200_ROWS:
        entry = one_config(load(root, H200.format(precision=precision, config=config)))
        h100 = load(root, H100[precision])["configs"].get(config)
        bitfit = entry["time"]["modes"]["dpzoo-bitfit"]
        cells = [
            label,
            precision,
            f"{entry['time']['modes']['nonprivate-full']['median_ms']:.1f}",
            time_memory(entry, "dpzoo-bk-mixopt"),
            f"{ratio(bitfit['time_ratio']['median'])} ({ratio(bitfit['time_ratio_second']['median'])})",
            time_memory(entry, "opacus-hooks"),
            "not run" if h100 is None else ratio(h100["time"]["modes"]["dpzoo-bk-mixopt"]["time_ratio"]["median"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


@table("h100-fp32", files=[H100["fp32"]], command="--out benchmarks/results/gpu")
def h100_fp32(root: Path) -> str:
    modes = ["nonprivate-bias", "dpzoo-bk-mixopt", "dpzoo-bk", "dpzoo-bitfit", "opacus-hooks", "opacus-ghost"]
    lines = [
        "| fp32 | non-private bias-only | dpzoo bk-mixopt | dpzoo bk | dpzoo bitfit (time of bias-only) "
        "| Opacus hooks | Opacus ghost |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for config, entry in load(root, H100["fp32"])["configs"].items():
        label = f"{H100_LABELS[config]} ({entry['time']['modes']['nonprivate-full']['median_ms']:.0f} ms)"
        cells = [time_memory(entry, m, second=m == "dpzoo-bitfit") for m in modes]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


CPU_LABELS = {"gpt2-4x256-v1024-tied": "gpt2 tied", "gpt2-4x256-v1024-untied": "gpt2 untied"}
CPU_MODES = [m for m in MODES if m != "nonprivate-full"]  # the benchmark's modes beside its baseline


def cpu_rows(root: Path, cell) -> list[str]:
    return [
        f"| {CPU_LABELS.get(config, config)} | " + " | ".join(cell(entry, m) for m in CPU_MODES) + " |"
        for config, entry in load(root, CPU)["configs"].items()
    ]


def cpu_time_cell(entry: dict, mode: str) -> str:
    """``1.28× [1.15–1.33]`` (median and interval over rounds); DP-BiTFiT's medians only, with its
    time against non-private bias-only in parentheses."""
    t = entry["time"]["modes"][mode]
    if t["status"] != "ok":
        return t["status"]
    if mode == "dpzoo-bitfit":
        return f"{ratio(t['time_ratio']['median'])} ({ratio(t['time_ratio_second']['median'])})"
    return step_table.cell(t["time_ratio"])


def cpu_memory_cell(entry: dict, mode: str) -> str:
    m = entry["memory"].get(mode) or entry["time"]["modes"][mode]  # a mode that could not run has no memory
    return ratio(m["ratio"]) if m.get("status") == "ok" else m["status"]


@table("cpu-step-time", files=[CPU], command="benchmarks/table.py benchmarks/results/training_step.json")
def cpu_time(root: Path) -> str:
    head = "| time / non-private full | non-private bias-only | dpzoo bk-mixopt | dpzoo bk | dpzoo instantiate "
    head += "| dpzoo bitfit (of bias-only) | Opacus hooks | Opacus ghost |"
    return "\n".join([head, "| --- " * 8 + "|"] + cpu_rows(root, cpu_time_cell))


@table("cpu-step-memory", files=[CPU], command="benchmarks/table.py benchmarks/results/training_step.json")
def cpu_memory(root: Path) -> str:
    head = "| peak memory / non-private full | bias-only | bk-mixopt | bk | instantiate | bitfit | Opacus hooks "
    head += "| Opacus ghost |"
    return "\n".join([head, "| --- " * 8 + "|"] + cpu_rows(root, cpu_memory_cell))


PROFILE = "benchmarks/results/gpu_h200/profile_resnet50-gn-bias_224_bf16.txt"
DEVICE_LOG = "benchmarks/results/gpu_h200/device_log.txt"
SETTINGS = {"1.1"}  # the llama config's size in billions of parameters (llama-bias-1b, "the 1.1B llama")


def profile_ms(root: Path) -> list[float]:
    """The profile's per-mode totals (step, forward, optimizer) and its per-operator and per-source-line
    device times, in ms."""
    text = (root / PROFILE).read_text()
    found = [float(x) for x in re.findall(r"^## [\w-]+: ([0-9.]+) ms/step.*?forward ([0-9.]+)", text, re.M) for x in x]
    found += [float(x) for x in re.findall(r"optimizer ([0-9.]+)\)", text)]
    return found + [float(x) for x in re.findall(r"^\s+([0-9.]+) ms ", text, re.M)]


@figures("gpu-h200", files=[*(H200.format(precision="bf16", config=c) for _, c, _ in H200_ROWS[:6]), PROFILE, DEVICE_LOG],
         command="bench_training_step.py --device cuda --rounds 5 --steps 2 --warmup 2")  # fmt: skip
def h200_figures(root: Path) -> set[str]:
    """bk-mixopt's bf16 time ratios, the ResNet-50 profile's times, the out-of-memory request and capacity."""
    bf16 = [one_config(load(root, H200.format(precision=p, config=c))) for p, c, _ in H200_ROWS if p == "bf16"]
    ratios = [e["time"]["modes"]["dpzoo-bk-mixopt"]["time_ratio"]["median"] for e in bf16]
    log = (root / DEVICE_LOG).read_text()
    memory = [float(x) for x in re.findall(r"Tried to allocate ([0-9.]+) GiB", log)]
    capacity = [float(x) for x in re.findall(r"total capacity of ([0-9.]+)", log)]
    return fixed(ratios, 1, 2) | fixed(profile_ms(root), 0, 1) | fixed(memory, 1) | fixed(capacity, 0) | SETTINGS
