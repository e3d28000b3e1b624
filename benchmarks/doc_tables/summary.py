"""docs/RESULTS.md's opening table: one line per result (task, metric, dpzoo, reference, command),
read from the same files as the sections below it."""

from __future__ import annotations

import statistics
from pathlib import Path

from reproduce_dpformer_ml1m import PAPER_EPS5

from doc_tables import table
from doc_tables.gpu import one_config
from doc_tables.prose import load
from doc_tables.seqrec import BASE, group, summary

MAIN_JOB = "benchmarks/results/main_job/main_job.json"
T200 = f"{BASE}/recipe_gpu/t200/summary.json"
MINILM = "benchmarks/results/minilm/main/results.json"
AUDIT = "benchmarks/results/audit/white_box_eps2_m50000_full.json"
H200_NOW = "benchmarks/results/gpu_h200_1128/head_297a653/{precision}_gpt2-small-t128.json"  # today's code
H200_FIRST = "benchmarks/results/gpu_h200_1128/bf16_gpt2-small-t128.json"  # the day's first call (97dd5d3)


def _span(values: list[float], digits: int = 2) -> str:
    return f"{min(values):.{digits}f}–{max(values):.{digits}f}"


def _main_job(root: Path) -> list[str]:
    d = load(root, MAIN_JOB)
    return [
        "Digits (8×8), `cnn-tanh-gn` from scratch, ε = 8",
        "test accuracy, mean of 5 runs",
        f"{100 * d['mean_test_accuracy']:.1f}%",
        f"{100 * d['non_private_test_accuracy']:.1f}% without DP",
        "`dpzoo train cnn-tanh-gn`",
    ]


def _dpformer(root: Path) -> list[str]:
    g = group(summary(root, "recipe_gpu/t200"), "dpformer")
    return [
        "MovieLens-1M next item, user-level ε = 5 (length 200)",
        "test NDCG@10, 3 seeds",
        f"DPFormer {g['ndcg@10_mean']:.2f} ± {g['ndcg@10_std']:.2f}%",
        f"{PAPER_EPS5['dpformer'][0]:.2f}% (the paper's Table 1)",
        "`dpzoo train dpformer --data ml-1m --epsilon 5 --max-len 200`",
    ]


def _minilm(root: Path) -> list[str]:
    rows = load(root, MINILM)["results"]
    mean = {m: statistics.mean(r["accuracy"] for r in rows if r["method"] == m) for m in {r["method"] for r in rows}}
    best = max((m for m in mean if m != "full"), key=mean.get)
    return [
        "MiniLM-L6 fine-tuning, 5 classes, ε = 8",
        "test accuracy, 3 seeds",
        f"{best} {mean[best]:.3f}",
        f"full DP {mean['full']:.3f}",
        "`python examples/dp_finetune_minilm_compare.py --seeds 0 1 2`",
    ]


def _audit(root: Path) -> list[str]:
    runs = load(root, AUDIT)["runs"]
    engine = [r["epsilon_lower_bound"] for r in runs if r["broken"] is None]
    doubled = [r["epsilon_lower_bound"] for r in runs if r["broken"] == "sensitivity-2x"]
    return [
        "White-box audit, full batch, 50,000 canaries",
        f"ε lower bound at 95%, claim {runs[0]['claimed_epsilon']:.2f}, 5 runs",
        f"engine {_span(engine)}",
        f"2R clip {_span(doubled)}",
        "`dpzoo audit --white-box --full-batch --canaries 50000`",
    ]


def _gpu(root: Path) -> list[str]:
    """The latest GPU measurement (H200, 11-28, library 7fe8445) in bf16 and fp32, and the day's
    first call (97dd5d3) in bf16."""
    now = {
        p: _modes(root, H200_NOW.format(precision=p))["dpzoo-bk-mixopt"]["time_ratio"]["median"]
        for p in ("fp32", "bf16")
    }
    first = _modes(root, H200_FIRST)["dpzoo-bk-mixopt"]["time_ratio"]["median"]
    return [
        "GPT-2 small, T 128, bf16, one H200 (11-28)",
        "DP step time / non-private (bk-mixopt)",
        f"{now['bf16']:.2f}×",
        f"fp32 {now['fp32']:.2f}×; bf16 the same day's first call: {first:.2f}×",
        "`python benchmarks/bench_training_step.py --device cuda`",
    ]


def _modes(root: Path, path: str) -> dict:
    return one_config(load(root, path))["time"]["modes"]


@table("results-summary", files=[MAIN_JOB, T200, MINILM, AUDIT, H200_FIRST,
                                 *(H200_NOW.format(precision=p) for p in ("fp32", "bf16"))],
       command="benchmarks/render_tables.py")  # fmt: skip
def results_summary(root: Path) -> str:
    lines = ["| task | metric | dpzoo | reference | command |", "|---|---|---|---|---|"]
    for row in (_main_job, _dpformer, _minilm, _audit, _gpu):
        lines.append("| " + " | ".join(row(root)) + " |")
    return "\n".join(lines)
