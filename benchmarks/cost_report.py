"""GPU cost without a GPU (issue 30): every mode of every GPU configuration traced at its real size
(:mod:`cost_trace`), its H100 and H200 step time predicted (:mod:`gpu_model`), and the model
checked against every measured GPU table in benchmarks/results.

    python benchmarks/cost_report.py --out benchmarks/results/cost          # all (~20 min on 2 cores)
    python benchmarks/cost_report.py --configs gpt2-small-t128 --precisions bf16 --no-validate

Writes ``cost_report.json``: per configuration, precision and mode the counts (operators, kernels,
host reads, Python calls, GFLOPs per unit, GB moved, peak memory), their ratios to the
non-private step (DP-BiTFiT also to the non-private bias-only step), and the predicted step times;
with validation, the model's constants calibrated on the newest measured table (H200, 2026-11-28, session 23) and its error on
every measured cell (``validation``), and ``validation.png`` (predicted against measured ratios).
Counts are the same on any machine; the predictions are a model's (docs/RESULTS.md says where it
misses).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import subprocess
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_modes  # noqa: E402
import cost_trace  # noqa: E402
import gpu_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# measured tables: (label, device, files, what code ran, the GPU's dense-norm run length then);
# the first is the calibration table
TABLES = [
    (
        "h200-2026-11-28 session 23",
        "h200",
        ["gpu_h200_1128/head_297a653/bf16_*.json", "gpu_h200_1128/head_297a653/fp32_*.json"],
        "7fe8445 (stacks of one shape, the freed path, the sums' guard; every layer forced onto each path too)",
        None,
    ),
    (
        "h200-2026-11-28",
        "h200",
        ["gpu_h200_1128/bf16_*.json", "gpu_h200_1128/fp32_*.json"],
        "97dd5d3 (fewer launches and host reads; dense norms over runs of 32)",
        32,
    ),
    (
        "h200-2026-11-28 runs of 1,024",
        "h200",
        ["gpu_h200_1128/dense_runs/bf16_*.json"],
        "0822966 (dense norms over runs of 1,024 on a GPU)",
        None,
    ),
    (
        "h200-2026-11-28 today's code",
        "h200",
        ["gpu_h200_1128/head_95928c5/bf16_*.json", "gpu_h200_1128/head_95928c5/fp32_*.json"],
        "95928c5 (output-gradient hooks, float32 guard row norms)",
        None,
    ),
    (
        "h200-2026-11-28 next session",
        "h200",
        ["gpu_h200_1128/head_ae809ef/bf16_*.json", "gpu_h200_1128/head_ae809ef/fp32_*.json"],
        "ae809ef (runs of 1,024; GPT-2 T512 and T1024, ResNet-50-GN)",
        None,
    ),
    (
        "h200-2026-11-27",
        "h200",
        ["gpu_h200_1127/bf16_*.json"],
        "2bb3e0b (bf16 convolution factors, fewer guard walks)",
        32,
    ),
    (
        "h100-2026-11-26",
        "h100",
        ["gpu_h100_1126/bf16_*.json", "gpu_h100_1126/fp32_*.json"],
        "6a6b4e7 (half-precision factors)",
        32,
    ),
    (
        "h200-2026-11-25",
        "h200",
        ["gpu_h200/bf16_*.json", "gpu_h200/fp32_*.json"],
        "2923122 (before half-precision factors)",
        32,
    ),
    (
        "h100-2026-11-24",
        "h100",
        ["gpu/training_step.json", "gpu/training_step_bf16.json"],
        "680ee46 (first GPU table)",
        32,
    ),
]
SECOND_BASELINE = bench_modes.SECOND_BASELINE


def trace_all(configs: list[str], precisions: list[str], modes: list[str] | None) -> dict:
    """(config, mode, precision) -> Trace, or the reason it could not be traced."""
    traces: dict = {}
    for config in configs:
        for precision in precisions:
            wanted = bench_modes.config_modes(config, modes or bench_modes.MODES)
            for mode in dict.fromkeys([bench_modes.BASELINE, *wanted, *(SECOND_BASELINE.get(m) for m in wanted)]):
                if mode is None:
                    continue
                try:
                    traces[config, mode, precision] = cost_trace.trace_step(config, mode, precision)
                except bench_modes.Unsupported as e:
                    traces[config, mode, precision] = f"unsupported: {e}"
                except Exception as e:  # noqa: BLE001  e.g. a single tensor past the tracing machine's memory
                    traces[config, mode, precision] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
                print(config, precision, mode, _short(traces[config, mode, precision]), flush=True)
    return traces


def _short(t) -> str:
    if isinstance(t, str):
        return t[:100]
    s = cost_trace.summarize(t)
    return f"{s['ops']} ops, {s['kernels']} kernels, {s['host_reads']} host reads, {s['peak_mb']:.0f} MB"


def _ratios(row: dict, base: dict) -> dict:
    keys = ("ops", "kernels", "host_reads", "python_calls", "gbytes", "peak_mb")
    out = {k: row[k] / base[k] if base[k] else None for k in keys}
    out["gflops"] = sum(row["gflops"].values()) / max(sum(base["gflops"].values()), 1e-12)
    for name in row["predicted"]:
        out[f"{name}_ms"] = row["predicted"][name]["ms"] / base["predicted"][name]["ms"]
    return out


def report(traces: dict, devices: dict) -> dict:
    """The JSON body: counts, predictions and ratios per configuration, precision and mode."""
    out: dict = {}
    for (config, mode, precision), t in traces.items():
        cfg = out.setdefault(config, {"config": bench_modes.ALL_CONFIGS[config], "precisions": {}})
        rows = cfg["precisions"].setdefault(precision, {})
        if isinstance(t, str):
            rows[mode] = {"status": "failed", "reason": t}
            continue
        row = {"status": "ok", **cost_trace.summarize(t)}
        row["predicted"] = {name: gpu_model.predict(t, d) for name, d in devices.items()}
        row["by_source_h100"] = gpu_model.by_source(t, devices["h100"])
        rows[mode] = row
    for cfg in out.values():
        for rows in cfg["precisions"].values():
            for mode, row in rows.items():
                for key, base_mode in (("ratio", bench_modes.BASELINE), ("ratio_to_second", SECOND_BASELINE.get(mode))):
                    base = rows.get(base_mode or "")
                    if row["status"] == "ok" and base and base["status"] == "ok":
                        row[key] = _ratios(row, base)
    return out


def measured_cells(patterns: list[str]) -> list[dict]:
    """Every measured (config, precision, mode) with a DP/non-private time ratio in the files."""
    cells = []
    for pattern in patterns:
        for path in sorted(RESULTS.glob(pattern)):
            data = json.loads(path.read_text())
            if "configs" not in data:
                continue
            precision = data["meta"].get("precision", "fp32")
            for config, body in data["configs"].items():
                for mode, m in body["time"]["modes"].items():
                    if m.get("status") == "ok" and mode != bench_modes.BASELINE:
                        memory = body.get("memory", {}).get(mode, {}).get("ratio")
                        cells.append(
                            {"config": config, "precision": precision, "mode": mode, "measured_ms": m["median_ms"],
                             "measured_ratio": m["time_ratio"]["median"], "measured_memory_ratio": memory,
                             "file": str(path.relative_to(RESULTS))}
                        )  # fmt: skip
    return cells


def validate(traces: dict) -> dict:
    """The model calibrated on the first table (leave-one-configuration-out errors too), then its
    error on every measured cell of every table; cells whose modes were not traced are skipped."""
    traced = {k: t for k, t in traces.items() if not isinstance(t, str)}
    tables = []
    for label, device, patterns, code, runs in TABLES:
        arrays = {k: gpu_model.arrays(t, dense_runs=runs) for k, t in traced.items()}  # priced as that code ran
        cells = [c for c in measured_cells(patterns) if cell_key(c) in arrays and baseline_key(c) in arrays]
        tables.append((label, device, code, cells, arrays))
    label, device, _, cells, arrays = tables[0]
    groups: dict = {}
    for c in cells:
        groups.setdefault(c["config"], []).append(c)  # both precisions of a configuration held out together
    triples = {
        g: [(arrays[cell_key(c)], arrays[baseline_key(c)], c["measured_ratio"]) for c in cs] for g, cs in groups.items()
    }
    fitted, held_out = gpu_model.calibrate(triples, gpu_model.DEVICES[device])
    for g, cs in groups.items():
        for c, e in zip(cs, held_out[g]):
            c["held_out_error"] = e
    constants = {k: getattr(fitted, k) for k in gpu_model.GRID}
    out = {"calibrated_on": label, "constants": constants, "tables": []}
    for label, device, code, cells, arrays in tables:
        d = dataclasses.replace(gpu_model.DEVICES[device], **constants)
        for c in cells:
            mode_ms = gpu_model.predict(arrays[cell_key(c)], d)["ms"]
            c["predicted_ms"] = mode_ms
            c["predicted_ratio"] = mode_ms / gpu_model.predict(arrays[baseline_key(c)], d)["ms"]
            c["error"] = c["predicted_ratio"] / c["measured_ratio"] - 1
            c["traced_memory_ratio"] = traces[cell_key(c)].peak_bytes / traces[baseline_key(c)].peak_bytes
        within = sum(abs(c["error"]) <= 0.2 for c in cells)
        out["tables"].append({"table": label, "device": device, "code": code, "cells": cells, "within_20pct": within})
    return out


def cell_key(c: dict) -> tuple:
    return c["config"], c["mode"], c["precision"]


def baseline_key(c: dict) -> tuple:
    return c["config"], bench_modes.BASELINE, c["precision"]


def plot(validation: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 6))
    for table, marker in zip(validation["tables"], "os^vDP<>"):
        xs = [c["measured_ratio"] for c in table["cells"]]
        ys = [c["predicted_ratio"] for c in table["cells"]]
        ax.scatter(xs, ys, marker=marker, label=f"{table['table']} ({table['within_20pct']}/{len(xs)} within 20%)")
    lim = [0.5, 8]
    ax.plot(lim, lim, "k-", lw=0.8)
    ax.fill_between(lim, [v * 0.8 for v in lim], [v * 1.2 for v in lim], color="grey", alpha=0.2)
    ax.set(xscale="log", yscale="log", xlim=lim, ylim=lim, xlabel="measured step time / non-private")
    ticks = [0.5, 1, 2, 4, 8]
    ax.set_xticks(ticks, [f"{t:g}×" for t in ticks])
    ax.set_yticks(ticks, [f"{t:g}×" for t in ticks])
    ax.minorticks_off()
    ax.set(ylabel="predicted step time / non-private", title="GPU model: DP/non-private time ratios")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plain(x):
    """numpy scalars (the model's arithmetic) as Python numbers, for JSON."""
    if hasattr(x, "item"):
        return x.item()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    gpu = list(bench_modes.GPU_CONFIGS)
    parser.add_argument(
        "--configs", nargs="+", default=gpu, choices=list(bench_modes.ALL_CONFIGS), help="default: the GPU table's"
    )
    parser.add_argument("--precisions", nargs="+", default=list(bench_modes.PRECISIONS), choices=bench_modes.PRECISIONS)
    parser.add_argument("--modes", nargs="+", default=None, help="default: every mode the config is benchmarked in")
    parser.add_argument("--no-validate", action="store_true", help="skip the comparison with the measured GPU tables")
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for cost_report.json (default: .)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    traces = trace_all(args.configs, args.precisions, args.modes)
    result: dict = {
        "meta": {
            "command": "python benchmarks/cost_report.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "git_commit": _commit(),
            "torch": cost_trace.torch.__version__,
            "python": platform.python_version(),
            "counts": "deterministic: the same on any machine (cost_trace.py)",
            "predicted": "gpu_model.py: a roofline per kernel, a host cost per operator and Python call",
        },
        "devices": {k: dataclasses.asdict(d) for k, d in gpu_model.DEVICES.items()},
    }
    devices = dict(gpu_model.DEVICES)
    if not args.no_validate:
        result["validation"] = validation = validate(traces)
        devices = {k: dataclasses.replace(d, **validation["constants"]) for k, d in devices.items()}
        result["devices"] = {k: dataclasses.asdict(d) for k, d in devices.items()}
    result["configs"] = report(traces, devices)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cost_report.json").write_text(json.dumps(result, indent=1, default=_plain))
    if not args.no_validate:
        plot(result["validation"], args.out / "validation.png")
        for t in result["validation"]["tables"]:
            print(f"{t['table']} ({t['code']}): {t['within_20pct']}/{len(t['cells'])} ratios within 20%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
