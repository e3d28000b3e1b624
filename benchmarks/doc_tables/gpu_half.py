"""docs/RESULTS.md's H100 table of 2026-11-26: the step cost after the per-token loss fix and the
half-precision factor path (benchmarks/results/gpu_h100_1126), beside the earlier runs' ratios."""

from __future__ import annotations

from pathlib import Path

from doc_tables import figures, table
from doc_tables.gpu import H100, H200, load, one_config, ratio, time_memory
from doc_tables.prose import fixed

RUN = "benchmarks/results/gpu_h100_1126/{precision}_{config}.json"
ROWS = [  # (precision, config, file name's config, label)
    ("bf16", "gpt2-small-t128", "gpt2-small-t128", "GPT-2 small T128 B32"),
    ("bf16", "gpt2-small-t512", "gpt2-small-t512", "GPT-2 small T512 B32"),
    ("bf16", "vit-base-patch16@224", "vit-base-patch16_224", "ViT-B/16 224² B64"),
    ("bf16", "resnet50-gn-bias@224", "resnet50-gn-bias_224", "ResNet-50-GN 224² B64"),
    ("bf16", "llama-bias-1b-t512", "llama-bias-1b-t512", "llama-bias 1.1B T512 B8"),
    ("fp32", "gpt2-small-t128", "gpt2-small-t128", "GPT-2 small T128 B32"),
    ("fp32", "vit-base-patch16@224", "vit-base-patch16_224", "ViT-B/16 224² B64"),
]
CONTROL = "benchmarks/results/gpu_h100_1126/control_{variant}_{config}.json"
CONTROL_ROWS = [("llama-bias-1b-t512", "llama-bias 1.1B T512 B8"), ("vit-base-patch16_224", "ViT-B/16 224² B64")]
CONTROL_FILES = [CONTROL.format(variant=v, config=c) for c, _ in CONTROL_ROWS for v in ("half", "nohalf")]
FILES = [RUN.format(precision=p, config=f) for p, _, f, _ in ROWS]


def _cell(entry: dict, mode: str, second: bool = False) -> str:
    if mode not in entry["time"]["modes"]:
        return "not run"
    return time_memory(entry, mode, second)


def _earlier(root: Path, precision: str, config: str) -> str:
    """bk-mixopt's time ratio on the H100 (11-24) and the H200 (11-25), where they ran."""
    h100 = load(root, H100[precision])["configs"].get(config)
    path = H200.format(precision=precision, config=config)
    h200 = one_config(load(root, path)) if (root / path).exists() else None
    return " / ".join(
        "—" if e is None else ratio(e["time"]["modes"]["dpzoo-bk-mixopt"]["time_ratio"]["median"]) for e in (h100, h200)
    )


EARLIER = [H200.format(precision=p, config=c) for p, c, _, _ in ROWS if (p, c) != ("fp32", "vit-base-patch16@224")]


@table("gpu-h100-half", files=FILES + list(H100.values()) + EARLIER,
       command="bench_training_step.py --device cuda --rounds 5 --steps 2 --warmup 2")  # fmt: skip
def h100_half(root: Path) -> str:
    lines = [
        "| config | precision | non-private (ms) | dpzoo bk-mixopt | dpzoo instantiate | DP-BiTFiT (of bias-only) "
        "| bk-mixopt before: H100 11-24 / H200 11-25 |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for precision, config, name, label in ROWS:
        entry = one_config(load(root, RUN.format(precision=precision, config=name)))
        cells = [
            label,
            precision,
            f"{entry['time']['modes']['nonprivate-full']['median_ms']:.1f}",
            _cell(entry, "dpzoo-bk-mixopt"),
            _cell(entry, "dpzoo-instantiate"),
            _cell(entry, "dpzoo-bitfit", second=True),
            _earlier(root, precision, config),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


@table("gpu-h100-half-control", files=CONTROL_FILES, command="PYTHONPATH=benchmarks/results/gpu_h100_1126/nohalf")
def h100_half_control(root: Path) -> str:
    lines = [
        "| config (bf16) | non-private (ms) | bk-mixopt, half-precision factors | bk-mixopt, float32 factors |",
        "| --- | --- | --- | --- |",
    ]
    for config, label in CONTROL_ROWS:
        runs = {
            v: one_config(load(root, CONTROL.format(variant=v, config=config)))["time"]["modes"]
            for v in ("half", "nohalf")
        }
        cells = [label, f"{runs['half']['nonprivate-full']['median_ms']:.1f}"]
        cells += [
            f"{runs[v]['dpzoo-bk-mixopt']['median_ms']:.1f} ms ({ratio(runs[v]['dpzoo-bk-mixopt']['time_ratio']['median'])})"
            for v in ("half", "nohalf")
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


@figures(
    "gpu-h100-half",
    files=FILES + CONTROL_FILES,
    command="bench_training_step.py --device cuda --rounds 5 --steps 2 --warmup 2",
)
def h100_half_figures(root: Path) -> set[str]:
    """The runs' step times (ms), time ratios and memory ratios."""
    values = []
    paths = [RUN.format(precision=p, config=name) for p, _, name, _ in ROWS] + CONTROL_FILES
    for path in paths:
        entry = one_config(load(root, path))
        values += [v for m in entry["time"]["modes"].values() for v in (m["median_ms"], m["time_ratio"]["median"])]
        values += [m["ratio"] for m in entry.get("memory", {}).values() if "ratio" in m]
    return fixed(values, 0, 1) | fixed(values, 1, 2)
