"""docs/RESULTS.md's GPU cost model tables (benchmarks/results/cost/cost_report.json): the model
against every measured cell of the H100 table it was calibrated on, its hit rate on the other
tables, and what it predicts for today's code in bf16 against the GPU targets."""

from __future__ import annotations

from pathlib import Path

from doc_tables import figures, table
from doc_tables.gpu import load, ratio

REPORT = "benchmarks/results/cost/cost_report.json"
COMMAND = "python benchmarks/cost_report.py --out benchmarks/results/cost"
LABELS = {
    "gpt2-small-t128": "GPT-2 small T128 B32",
    "gpt2-small-t512": "GPT-2 small T512 B32",
    "gpt2-small-t1024": "GPT-2 small T1024 B32",
    "vit-base-patch16@224": "ViT-B/16 224² B64",
    "resnet50-gn-bias@224": "ResNet-50-GN 224² B64",
    "llama-bias-1b-t512": "llama-bias 1.1B T512 B8",
}
# the predicted-H100-bf16 targets: (config, mode, ratio to which baseline, at most)
TARGETS = [
    ("gpt2-small-t128", "dpzoo-bk-mixopt", "ratio", 1.15),
    ("gpt2-small-t512", "dpzoo-bk-mixopt", "ratio", 1.15),
    ("vit-base-patch16@224", "dpzoo-bk-mixopt", "ratio", 1.3),
    ("resnet50-gn-bias@224", "dpzoo-bk-mixopt", "ratio", 1.6),
    ("llama-bias-1b-t512", "dpzoo-bitfit", "ratio_to_second", 1.05),
]
TARGET_FIGURES = {f"{t:g}" for *_, t in TARGETS}  # as the prose writes them


def _pct(x: float) -> str:
    return f"{x:+.0%}".replace("-", "−")


@table("gpu-model-validation", files=[REPORT], command=COMMAND)
def validation(root: Path) -> str:
    v = load(root, REPORT)["validation"]
    table0 = v["tables"][0]
    lines = [
        "| config | precision | mode | time: measured | predicted | error | error, fitted without this config "
        "| peak memory: measured | traced |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in table0["cells"]:
        memory = c["measured_memory_ratio"]
        cells = [LABELS[c["config"]], c["precision"], c["mode"], ratio(c["measured_ratio"]), ratio(c["predicted_ratio"]),
                 _pct(c["error"]), _pct(c["held_out_error"]), ratio(memory) if memory else "not measured",
                 ratio(c["traced_memory_ratio"])]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


@table("gpu-model-tables", files=[REPORT], command=COMMAND)
def tables(root: Path) -> str:
    v = load(root, REPORT)["validation"]
    lines = ["| measured table | code it measured | DP/non-private ratios within 20% |", "| --- | --- | --- |"]
    for t in v["tables"]:
        held = ""
        if t["table"] == v["calibrated_on"]:
            n = sum(abs(c["held_out_error"]) <= 0.2 for c in t["cells"])
            held = f" (calibrated here; {n}/{len(t['cells'])} fitted without the cell's config)"
        lines.append(
            f"| {t['table']} ({t['device'].upper()}) | {t['code']} | {t['within_20pct']}/{len(t['cells'])}{held} |"
        )
    return "\n".join(lines)


# the measured H200 cell of each target (11-28, timed plan), the latest code each was run at: session
# 23's call (7fe8445), ResNet-50-GN last measured at ae809ef
LATEST = "benchmarks/results/gpu_h200_1128/head_297a653/bf16_{config}.json"
MEASURED = {
    "gpt2-small-t128": (LATEST.format(config="gpt2-small-t128"), "time_ratio"),
    "gpt2-small-t512": (LATEST.format(config="gpt2-small-t512"), "time_ratio"),
    "vit-base-patch16@224": (LATEST.format(config="vit-base-patch16@224"), "time_ratio"),
    "resnet50-gn-bias@224": (
        "benchmarks/results/gpu_h200_1128/head_ae809ef/bf16_resnet50-gn-bias@224.json",
        "time_ratio",
    ),
    "llama-bias-1b-t512": (LATEST.format(config="llama-bias-1b-t512"), "time_ratio_second"),
}


def _measured(root: Path, config: str, mode: str) -> str:
    if config not in MEASURED:
        return "not measured with the timed plan"
    path, key = MEASURED[config]
    (entry,) = load(root, path)["configs"].values()
    return ratio(entry["time"]["modes"][mode][key]["median"])


TIMED = "benchmarks/results/cost/timed_plan/{config}.json"  # cost_predict.py --timed-plan h200, at today's code


def _timed_prediction(root: Path, config: str, mode: str, key: str, what: str = "h200_ms") -> str:
    rows = load(root, TIMED.format(config=config))["modes"]
    base = rows["nonprivate-bias" if key == "ratio_to_second" else "nonprivate-full"]
    return ratio(rows[mode][what] / base[what])


@table("gpu-model-targets", files=[REPORT, *(f for f, _ in MEASURED.values()), *(TIMED.format(config=c) for c, *_ in TARGETS)],
       command=COMMAND)  # fmt: skip
def targets(root: Path) -> str:
    configs = load(root, REPORT)["configs"]
    lines = [
        "| config (bf16) | mode | predicted H100 time ratio (the model's plan) | measured H200 (2026-11-28, timed plan) "
        "| predicted H200, today's code (timed plan) | target | predicted peak memory ratio: the model's plan / timed |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for config, mode, key, target in TARGETS:
        row = configs[config]["precisions"]["bf16"][mode]
        base = "bias-only" if key == "ratio_to_second" else "non-private"
        cells = [
            LABELS[config],
            f"{mode} (of {base})",
            ratio(row[key]["h100_ms"]),
            _measured(root, config, mode),
            _timed_prediction(root, config, mode, key),
            f"≤ {target}×",
            f"{ratio(row[key]['peak_mb'])} / {_timed_prediction(root, config, mode, key, 'peak_mb')}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


@figures("gpu-model", files=[REPORT], command=COMMAND)
def model_figures(root: Path) -> set[str]:
    """The calibration table's ratios and errors (in %), the model's constants, the predictions."""
    data = load(root, REPORT)
    v = data["validation"]
    out = set()
    for c in v["tables"][0]["cells"]:
        out |= {_pct(c["held_out_error"])[:-1]}
    # the calibration table and the later calls of 2026-11-28, today's code among them
    for c in (c for t in v["tables"] if t["table"].startswith("h200-2026-11-28") for c in t["cells"]):
        out |= {_pct(c["error"])[:-1]}
        out |= {f"{c['measured_ratio']:.2f}", f"{c['predicted_ratio']:.2f}", f"{c['traced_memory_ratio']:.2f}"}
        out |= {f"{c['measured_memory_ratio']:.2f}"} if c["measured_memory_ratio"] else set()
    out |= {f"{value * 1e6:g}" if key.endswith("_s") else f"{value:g}" for key, value in v["constants"].items()}
    out |= {"20", "80"}  # the bar: ratios within 20% on at least 80% of the measured cells
    for cfg in data["configs"].values():
        for rows in cfg["precisions"].values():
            for row in rows.values():
                for key in ("ratio", "ratio_to_second"):
                    out |= {f"{x:.2f}" for x in row.get(key, {}).values() if x is not None}
    return out


WALKS = ["benchmarks/results/cost/guard_walks/before.json", "benchmarks/results/cost/guard_walks/after.json"]


@figures("gpu-guard-walks", files=WALKS, command="benchmarks/cost_predict.py")
def guard_walks_figures(root: Path) -> set[str]:
    """The predicted step times (ms) and ratios before and after the guards' flat walk."""
    out = set()
    for path in WALKS:
        for row in load(root, path)["modes"].values():
            out |= {
                f"{row['h200_ms']:.1f}",
                f"{row['h100_ms']:.1f}",
                f"{row['h200_ratio']:.2f}",
                f"{row['h100_ratio']:.2f}",
            }
    return out


HOST_READ_CONFIGS = [
    "gpt2-small-t128",
    "gpt2-small-t512",
    "vit-base-patch16@224",
    "resnet50-gn-bias@224",
    "llama-bias-1b-t512",
]
HOST_READS = [f"benchmarks/results/cost/host_reads/before/{c}.json" for c in HOST_READ_CONFIGS] + [
    f"benchmarks/results/cost/host_reads/after/{c}.json" for c in HOST_READ_CONFIGS
]


def _prediction_figures(root: Path, paths: list[str], memory: bool = False) -> set[str]:
    """Host reads, operators and predicted H200 ratios (to non-private full and to bias-only) of the
    DP modes in the timed-plan predictions ``paths``; with ``memory`` their peak memory too (GB, and
    its ratio to non-private full)."""
    out = set()
    for path in paths:
        modes = load(root, path)["modes"]
        for key in ("dpzoo-bk-mixopt", "dpzoo-bitfit"):
            row = modes[key]
            out |= {str(row["host_reads"]), f"{row['ops']:,}", f"{row['h200_ratio']:.2f}"}
            out.add(f"{row['h200_ms'] / modes['nonprivate-bias']['h200_ms']:.2f}")
            if memory:
                out |= {f"{row['peak_mb'] / 1024:.1f}", f"{row['peak_mb'] / modes['nonprivate-full']['peak_mb']:.2f}"}
    return out


@figures("gpu-host-reads", files=HOST_READS, command="benchmarks/cost_predict.py")
def host_reads_figures(root: Path) -> set[str]:
    """Before and after one host read per step served every dense norm (timed plans)."""
    return _prediction_figures(root, HOST_READS)


# the timed-plan predictions made at 163f862, before the H200 of 11-28 measured that code
PREDICTED_163F862 = "benchmarks/results/cost/predicted_163f862/{config}.json"
LAUNCHES = [f"benchmarks/results/cost/host_reads/after/{c}.json" for c in HOST_READ_CONFIGS] + [
    PREDICTED_163F862.format(config=c) for c in HOST_READ_CONFIGS
]


@figures("gpu-launches", files=LAUNCHES, command="benchmarks/cost_predict.py")
def launches_figures(root: Path) -> set[str]:
    """Before and after the step's kernels were batched (stacked dense norms, batched Grams, one
    read for every guard and clipped sum, the noise in one draw; timed plans), peak memory too."""
    return _prediction_figures(root, LAUNCHES, memory=True)
