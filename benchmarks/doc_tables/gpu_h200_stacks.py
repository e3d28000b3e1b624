"""docs/RESULTS.md's H200 table of the stacked ghost path, the freed instantiation and the clipped
sums' guard (library 7fe8445, 2026-11-28, session 23: ``benchmarks/results/gpu_h200_1128/head_297a653``),
with the figures its prose quotes: profiles, the planner's timings, the guard's float64 samples."""

from __future__ import annotations

import json
from pathlib import Path

from doc_tables import figures, table
from doc_tables.gpu import load
from doc_tables.gpu_h200_1128 import COMMAND, TODAY_FILES, call_table, run_values
from doc_tables.gpu_h200_1128 import PLAN_CHOICES as PLAN_BEFORE
from doc_tables.gpu_model import TARGET_FIGURES
from doc_tables.gpu_stacks import AFTER
from doc_tables.prose import fixed, numbers_in

DIR = "benchmarks/results/gpu_h200_1128/head_297a653"
RUN = DIR + "/{precision}_{config}.json"
CONFIGS = ["gpt2-small-t128", "gpt2-small-t512", "vit-base-patch16@224", "llama-bias-1b-t512"]
FILES = [RUN.format(precision="bf16", config=c) for c in CONFIGS] + [RUN.format(precision="fp32", config=CONFIGS[0])]
PROFILES = [DIR + f"/profile_{c}_bf16.json" for c in ("gpt2-small-t128", "llama-bias-1b-t512")]
HOST = [DIR + f"/host_llama-bias-1b-t512_{m}_bf16.json" for m in ("nonprivate-bias", "dpzoo-bitfit")]
PLAN_CHOICES = DIR + "/plan_choices_gpt2-small-t128.jsonl"
PREDICTED = [AFTER.format(config=c) for c in ("gpt2-small-t128", "vit-base-patch16@224")]
BEFORE = TODAY_FILES + [PLAN_BEFORE]  # the call before (library 95928c5), which the prose compares with
GUARD = [
    DIR + f"/sum_guard_gpt2-small-{t}_{m}.json" for t in ("t512", "t1024") for m in ("dpzoo-bk", "dpzoo-bk-mixopt")
]


@table("gpu-h200-1128-stacks", files=FILES, command=COMMAND)
def h200_stacks(root: Path) -> str:
    return call_table(root, RUN, CONFIGS)


def _host_ms(root: Path) -> list[float]:
    """Each host profile's step times and its dpzoo functions' cumulative milliseconds."""
    values = []
    for path in HOST:
        data = load(root, path)
        values += [data["step_ms"], data["profiled_step_ms"]]
        values += [r["cumulative_ms_per_step"] for r in data["by_cumulative_time"] + data["by_own_time"]]
        values += [r["own_ms_per_step"] for r in data["by_cumulative_time"] + data["by_own_time"]]
    return values


def _plans(root: Path, path: str) -> list[float]:
    values = []
    for line in (root / path).read_text().splitlines():  # one JSON per plan
        plan = json.loads(line)
        values += [plan["ms_per_step"]] + [r[k] for r in plan["timed_rows"] for k in ("ghost_ms", "instantiate_ms")]
    return values


@figures(
    "gpu-h200-1128-stacks",
    files=FILES + PROFILES + HOST + GUARD + [PLAN_CHOICES] + BEFORE + PREDICTED,
    command=COMMAND,
)
def h200_stacks_figures(root: Path) -> set[str]:
    """The runs' times and ratios (and the call before's), the profiles' ms, the host profiles', the
    planner's timings, the stacks' predicted ratios and the sums' guard: samples sent to float64 and
    the smallest ||g|| / (kappa U)."""
    values = []
    for path in FILES:
        values += run_values(root, path)
    for path in PROFILES:
        values += numbers_in(load(root, path)["modes"])
    values += _host_ms(root)
    values += _plans(root, PLAN_CHOICES) + _plans(root, PLAN_BEFORE)
    for path in TODAY_FILES:
        values += run_values(root, path)
    for path in PREDICTED:  # the stacks' predicted ratios to non-private
        modes = load(root, path)["modes"]
        values += [m["h200_ms"] / modes["nonprivate-full"]["h200_ms"] for m in modes.values()]
    counts = set()
    for path in GUARD:
        data = load(root, path)
        counts |= {str(n) for n in data["samples_to_float64"]}
        values += [r["min_ratio"] for r in data["per_param_last_step"].values()]
    return fixed(values, 0, 1, 2) | counts | TARGET_FIGURES
