"""docs/BENCHMARKS.md's CPU step cost against the physical floor (benchmarks/results/floor): the
non-private step plus a noise draw for every trainable coordinate, timed among the modes."""

from __future__ import annotations

import statistics
from pathlib import Path

from doc_tables import figures, table
from doc_tables.gpu import load, ratio

FLOOR = "benchmarks/results/floor/training_step.json"
COMMAND = "--modes dpzoo-bk-mixopt --rounds 9 --no-memory --out benchmarks/results/floor"
LABELS = {"gpt2-4x256-v1024-tied": "GPT-2 4×256 (tied), B16 T128", "resnet18-gn-bias@32": "ResNet-18-GN 32², B32"}
DP_MODES = ("dpzoo-bk-mixopt",)


def over_floor(modes: dict, mode: str) -> dict:
    """A mode's per-round time over the floor's in the same round: median, min, max."""
    per_round = [
        statistics.median(m) / statistics.median(f) for m, f in zip(modes[mode]["round_ms"], modes["floor"]["round_ms"])
    ]
    return {"median": statistics.median(per_round), "low": min(per_round), "high": max(per_round)}


def _cell(q: dict) -> str:
    return f"{q['median']:.2f}× [{q['low']:.2f}–{q['high']:.2f}]"


REUSE = "benchmarks/results/floor_reuse/training_step.json"
REUSE_COMMAND = (
    "--modes dpzoo-bk-mixopt dpzoo-bk --rounds 9 --no-memory --reuse-freed-memory --out benchmarks/results/floor_reuse"
)


@table("cpu-floor", files=[FLOOR], command=COMMAND)
def floor_table(root: Path, path: str = FLOOR) -> str:
    data = load(root, path)
    lines = [
        "| config | non-private (ms) | floor / non-private | "
        + " | ".join(f"{m.removeprefix('dpzoo-')} / non-private | {m.removeprefix('dpzoo-')} / floor" for m in DP_MODES)
        + " |",
        "| --- | --- | --- |" + " --- | --- |" * len(DP_MODES),
    ]
    for config, entry in data["configs"].items():
        modes = entry["time"]["modes"]
        cells = [LABELS.get(config, config), f"{modes['nonprivate-full']['median_ms']:.0f}"]
        cells.append(_cell(modes["floor"]["time_ratio"]))
        for m in DP_MODES:
            cells += [_cell(modes[m]["time_ratio"]), _cell(over_floor(modes, m))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


@figures("cpu-floor", files=[FLOOR], command=COMMAND)
def floor_figures(root: Path, path: str = FLOOR) -> set[str]:
    """Medians and interval ends of every ratio in the table (and of every other DP mode timed), and the step times."""
    out: set[str] = set()
    for entry in load(root, path)["configs"].values():
        modes = entry["time"]["modes"]
        dp = [m for m in modes if m.startswith("dpzoo-") and modes[m].get("status") == "ok"]
        qs = [modes[m]["time_ratio"] for m in ("floor", *dp)] + [over_floor(modes, m) for m in dp]
        out |= {f"{q[k]:.2f}" for q in qs for k in ("median", "low", "high")}
        out |= {f"{m['median_ms']:.0f}" for m in modes.values() if m.get("status") == "ok"}
    return out | {ratio(1.15).removesuffix("×")}


@table("cpu-floor-reuse", files=[REUSE], command=REUSE_COMMAND)
def floor_reuse_table(root: Path) -> str:
    """The same run with freed memory kept for reuse (dpzoo.cpu_allocator), every mode alike."""
    return floor_table(root, REUSE)


@figures("cpu-floor-reuse", files=[REUSE, FLOOR], command=REUSE_COMMAND)
def floor_reuse_figures(root: Path) -> set[str]:
    return floor_figures(root, REUSE) | floor_figures(root, FLOOR)


REPEATS = [REUSE] + [f"benchmarks/results/floor_reuse/repeat{i}/training_step.json" for i in range(1, 5)]
# in a loop over i = 1..4, ResNet-18-GN alone
REPEATS_COMMAND = (
    "--modes dpzoo-bk-mixopt --rounds 9 --no-memory --reuse-freed-memory --out benchmarks/results/floor_reuse/repeat$i"
)
REPEATED = "resnet18-gn-bias@32"


def _repeats(root: Path) -> list[tuple[dict, dict]]:
    """Per run of the repeated config: (its modes, bk-mixopt over the floor)."""
    out = []
    for path in REPEATS:
        modes = load(root, path)["configs"][REPEATED]["time"]["modes"]
        out.append((modes, over_floor(modes, "dpzoo-bk-mixopt")))
    return out


@table("cpu-floor-repeats", files=REPEATS, command=REPEATS_COMMAND)
def floor_repeats_table(root: Path) -> str:
    """ResNet-18-GN's step against the floor in separate runs of the benchmark (freed memory kept):
    within a run the modes alternate round by round; between runs the machine's speed moves."""
    lines = [
        "| run | non-private (ms) | floor (ms) | bk-mixopt (ms) | bk-mixopt / floor |",
        "| --- | --- | --- | --- | --- |",
    ]
    for i, (modes, q) in enumerate(_repeats(root)):
        ms = [f"{modes[m]['median_ms']:.0f}" for m in ("nonprivate-full", "floor", "dpzoo-bk-mixopt")]
        lines.append(f"| {i + 1} | " + " | ".join(ms) + f" | {_cell(q)} |")
    return "\n".join(lines)


@figures("cpu-floor-repeats", files=REPEATS, command=REPEATS_COMMAND)
def floor_repeats_figures(root: Path) -> set[str]:
    """Each run's figures, the range of the runs' medians and their median, and the target."""
    runs = [q for _, q in _repeats(root)]
    medians = sorted(q["median"] for q in runs)
    out = {f"{x:.2f}" for q in runs for x in q.values()}
    out |= {f"{statistics.median(medians):.2f}", str(len(medians)), ratio(1.15).removesuffix("×")}
    return out | {f"{sum(m <= 1.15 for m in medians)}"}


COUNTS = "benchmarks/results/floor/flops.json"
COUNTS_COMMAND = "python benchmarks/floor_flops.py --out benchmarks/results/floor"


@table("cpu-floor-counts", files=[COUNTS], command=COUNTS_COMMAND)
def floor_counts_table(root: Path) -> str:
    """What each mode computes and moves in one traced step, against the non-private step."""
    data = load(root, COUNTS)
    lines = [
        "| config | mode | GFLOP | / non-private | GB moved | / non-private | operators | host reads |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for config, modes in data["configs"].items():
        for mode, c in modes.items():
            lines.append(
                f"| {LABELS.get(config, config)} | {mode.removeprefix('dpzoo-')} | {c['gflops']:.1f} | "
                f"{c['gflops_ratio']:.3f}× | {c['gbytes']:.2f} | {c['gbytes_ratio']:.2f}× | {c['ops']} | {c['host_reads']} |"
            )
    return "\n".join(lines)


@figures("cpu-floor-counts", files=[COUNTS, FLOOR], command=COUNTS_COMMAND)
def floor_counts_figures(root: Path) -> set[str]:
    """The counts' ratios (and the floor's figures the prose compares them with)."""
    out = floor_figures(root)
    for modes in load(root, COUNTS)["configs"].values():
        for c in modes.values():
            out |= {f"{c['gflops_ratio']:.3f}", f"{c['gflops_ratio']:.2f}", f"{c['gbytes_ratio']:.2f}", str(c["ops"])}
        base = modes["nonprivate-full"]["gflops"]
        out |= {f"{(c['gflops'] / base - 1) * 100:.0f}" for c in modes.values()}
    return out
