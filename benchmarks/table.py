"""Print the markdown tables of a training_step.json (docs/BENCHMARKS.md's benchmark tables).

Time: the median over interleaved rounds of each mode's per-round step-time ratio to non-private
full training, with the interval the JSON names (min–max over rounds), e.g. ``1.39× [1.21–1.52]``;
DP-BiTFiT also against non-private bias-only, in parentheses. Memory: peak memory of each mode's own
process (CPU: the peak RSS the training steps add to the built model) as a ratio to non-private full. Every number comes from the JSON.

python benchmarks/table.py benchmarks/results/training_step.json
"""

from __future__ import annotations

import json
import sys

FLOOR = "floor"  # bench_modes.FLOOR (this script reads JSON and imports no benchmark module)


def cell(q: dict) -> str:
    """``1.39× [1.21–1.52]`` from a ratio summary (median, low, high)."""
    return f"{q['median']:.2f}× [{q['low']:.2f}–{q['high']:.2f}]"


def time_cell(r: dict | None) -> str:
    if r is None:
        return ""
    if r["status"] != "ok":
        return r["status"]
    text = cell(r["time_ratio"])
    if "time_ratio_second" in r:
        text += f" ({cell(r['time_ratio_second'])} of {r['second_baseline']})"
    return text


def memory_cell(r: dict | None) -> str:
    if r is None:
        return ""
    if r.get("status") != "ok" or "ratio" not in r:
        return r.get("status", "")
    return f"{r['ratio']:.2f}×"


def batch_cell(r: dict | None) -> str:
    """``512`` or ``≥ 512`` (the search stopped at its cap), ``none`` when not even the config's batch fits."""
    if r is None:
        return ""
    if r["largest_batch"] is None:
        return "none"
    return f"≥ {r['largest_batch']}" if r["capped"] else str(r["largest_batch"])


def tables(data: dict) -> str:
    meta = data["meta"]
    modes = meta["modes"]
    # the physical floor (non-private step + noise on every trainable coordinate), where timed
    timed = modes + [FLOOR] * any(FLOOR in e["time"]["modes"] for e in data["configs"].values())
    lines = [f"| step time / {meta['baseline']} | " + " | ".join(timed) + " |"]
    lines.append("| --- | " + " | ".join("---" for _ in timed) + " |")
    for c, e in data["configs"].items():
        lines.append(f"| {c} | " + " | ".join(time_cell(e["time"]["modes"].get(m)) for m in timed) + " |")
    if any("memory" in e for e in data["configs"].values()):
        what = "peak CUDA memory" if meta["machine"]["device"].startswith("cuda") else "peak RSS added by the steps"
        lines += ["", f"| {what} / {meta['baseline']} | " + " | ".join(modes) + " |"]
        lines.append("| --- | " + " | ".join("---" for _ in modes) + " |")
        for c, e in data["configs"].items():
            if "memory" in e:
                lines.append(f"| {c} | " + " | ".join(memory_cell(e["memory"].get(m)) for m in modes) + " |")
    if any("largest_batch" in e for e in data["configs"].values()):
        lines += ["", "| largest batch that fits | " + " | ".join(modes) + " |"]
        lines.append("| --- | " + " | ".join("---" for _ in modes) + " |")
        for c, e in data["configs"].items():
            if "largest_batch" in e:
                lines.append(f"| {c} | " + " | ".join(batch_cell(e["largest_batch"].get(m)) for m in modes) + " |")
    reasons = {
        (c, m): r["reason"]
        for c, e in data["configs"].items()
        for m, r in e["time"]["modes"].items()
        if r["status"] != "ok"
    }
    lines.append("")
    base = ", ".join(
        f"{c} {e['time']['modes'][meta['baseline']]['median_ms']:.0f}"
        for c, e in data["configs"].items()
        if meta["baseline"] in e["time"]["modes"]
    )
    lines.append(f"{meta['baseline']} step (ms, median over rounds): {base}.")
    for (c, m), reason in reasons.items():
        lines.append(f"{m} on {c}: {reason}")
    mach = meta["machine"]
    lines.append(
        f"{meta['rounds']} rounds × {meta['steps_per_round']} steps, interval: {meta['interval']} "
        f"({100 * meta['interval_coverage']:.1f}%); {meta.get('precision', 'fp32')}; {mach['device']}"
        + (f" {mach['gpu']}" if mach.get("gpu") else f", {mach['cpu_model']}, {mach['threads']} threads")
        + f", torch {mach['torch']}, opacus {mach.get('opacus')}."
    )
    lines.append(f"Command: `{meta['command']}`")
    if meta.get("notes"):
        lines.append(f"Note: {meta['notes']}")
    return "\n".join(lines)


def main(path: str) -> None:
    with open(path) as f:
        print(tables(json.load(f)))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/training_step.json")
