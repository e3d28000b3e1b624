"""The figures in the prose of docs/RESULTS.md's sections on DP next-item recommendation on
MovieLens-1M ("DP next-item recommendation at ε = 5: the recipe" and "DPFormer on MovieLens-1M",
down to "Why the paper's ordering does not show here"), from the files that
:mod:`doc_tables.seqrec` renders those sections' tables from.

One renderer per family of runs; each computes the figures as the prose states them (means and
stds at two decimals, differences in points at one, ratios in %) rather than accepting every
number of a file. Protocol settings and the paper's figures are declared apart (``SETTINGS``,
``PAPER``).
"""

from __future__ import annotations

import math
from pathlib import Path

from doc_tables import figures
from doc_tables.prose import fixed, load, signed
from doc_tables.seqrec import BASE, CPU_CURVES, CPU_NONPRIVATE, DIAGNOSTICS, DIAGNOSTICS_EPS20, GPU100, PAPER_EPS5

# Settings the prose names beside the runs (not measurements): dropout 0.2 (SASRec's, the zoo
# card's default, `--set dropout=0.2`), the positional embedding's init std 0.02
# (dpzoo/seqrec/modeling.py) and the learning-rate warm-up, 20% of the steps (paper App. E.3).
SETTINGS = {"0.2", "0.02", "20"}
# The DPFormer paper's Table 1, MovieLens-1M, ε = 5, NDCG@10 in %: vanilla DP Transformer and
# DPFormer (PAPER_EPS5 of benchmarks/reproduce_dpformer_ml1m.py).
PAPER = fixed([PAPER_EPS5["transformer-seqrec"][0], PAPER_EPS5["dpformer"][0]], 2)

RECIPE_COMMAND = "dpzoo train transformer-seqrec --data ml-1m --epsilon 5 --max-len 50"
SUMMARIZE = "python benchmarks/summarize_seqrec_runs.py"
GPU100_COMMAND = f"{SUMMARIZE} {GPU100}"
TF = "transformer-seqrec"


def points(values) -> set[str]:
    """NDCG@10 values already in %, at two decimals (``4.93``)."""
    return fixed(values, 2)


def groups_of(root: Path, folder: str) -> list[dict]:
    return load(root, f"{BASE}/{folder}/summary.json")["groups"]


def group(groups: list[dict], model: str = TF, epsilon: float | None = 5.0, lr=None, batch_size=None) -> dict:
    (g,) = [
        g
        for g in groups
        if (g["model"], g["epsilon"]) == (model, epsilon)
        and lr in (None, g["lr"])
        and batch_size in (None, g["batch_size"])
    ]
    return g


def mean_std(g: dict, metric: str = "ndcg@10") -> set[str]:
    return points([g[f"{metric}_mean"], g[f"{metric}_std"]])


def final_test(run: dict) -> float:
    """A run's test NDCG@10 in % at its last evaluation."""
    return 100 * run["history"][-1]["test_ndcg@10"]


# --- the recipe at ε = 5, T = 50: the ablation, its runs and the tuning ----------------------

ABLATION = {  # configuration -> folder under BASE (3 seeds each, transformer-seqrec, ε = 5)
    "recipe": "recipe_cpu/recipe",
    "public": "recipe_gpu/public",
    "noprior": "recipe_gpu/noprior",
    "dropout": "recipe_cpu/dropout02",
    "public_dropout": "recipe_gpu/public_dropout02",
    "noprior_dropout": "recipe_gpu/noprior_dropout02",
}
NONPRIVATE_REFERENCE = "recipe_cpu/nonprivate_reference"
CPU_RUNS = {  # the ε = 5 runs on the 2-core CPU, by configuration and seed
    "recipe": [f"{BASE}/recipe_cpu/recipe/runs/{TF}_eps5_seed{s}.json" for s in range(3)],
    "dropout": [f"{BASE}/recipe_cpu/dropout02/runs/{TF}_eps5_seed{s}.json" for s in range(3)],
    "noprior_dropout": [f"{BASE}/recipe_cpu/noprior_dropout02/runs/{TF}_eps5_seed0.json"],
}
EXPLORATION = f"{BASE}/recipe_cpu/exploration"
HARNESS = {
    opt: f"{EXPLORATION}/{name}"
    for opt, name in (
        ("adam", "adam_public_counts_dropout02_seed0.json"),
        ("sgd", "sgd_lr0.5_momentum0.9_public_counts_dropout02_seed0.json"),
    )
}


@figures(
    "seqrec-recipe",
    files=(
        *(f"{BASE}/{f}/summary.json" for f in (*ABLATION.values(), NONPRIVATE_REFERENCE)),
        *(p for paths in CPU_RUNS.values() for p in paths),
        *HARNESS.values(),
    ),
    command=RECIPE_COMMAND,
)
def recipe(root: Path) -> set[str]:
    """The recipe's result, its protocol, each ingredient's share, the learning curves and the
    validation figures the tuning decided on."""
    rows = {k: group(groups_of(root, folder)) for k, folder in ABLATION.items()}
    nonprivate = group(groups_of(root, NONPRIVATE_REFERENCE), epsilon=None)
    m = {k: g["ndcg@10_mean"] for k, g in rows.items()}  # mean test NDCG@10 (%) over the 3 seeds
    out = mean_std(rows["recipe"]) | points([*m.values(), nonprivate["ndcg@10_mean"]])
    # each ingredient, in points: the prior (without / with dropout), no dropout (with / without
    # the prior), the prior released privately rather than assumed public (without / with dropout)
    differences = [
        m["recipe"] - m["noprior"],
        m["dropout"] - m["noprior_dropout"],
        m["recipe"] - m["dropout"],
        m["noprior"] - m["noprior_dropout"],
        m["public"] - m["recipe"],
        m["public_dropout"] - m["dropout"],
    ]
    out |= fixed(differences, 1) | signed(differences, 1)
    # share of the non-private model's NDCG@10 kept by the recipe and by the old default
    out |= fixed(
        [m["recipe"] / nonprivate["ndcg@10_mean"], m["noprior_dropout"] / nonprivate["ndcg@10_mean"]], 0, scale=100
    )
    runs = {k: [load(root, p) for p in paths] for k, paths in CPU_RUNS.items()}
    first = runs["recipe"][0]
    # σ of DP-SGD with the prior's release charged to ε, and without a prior
    out |= fixed([first["noise_multiplier"], runs["noprior_dropout"][0]["noise_multiplier"]], 3)
    out |= fixed([first["sample_rate"]], 2)  # q = B/N
    # popularity (exact counts): test, and validation (what the released prior is compared with)
    out |= fixed([first["popularity"]["test"]["ndcg@10"], first["popularity"]["valid"]["ndcg@10"]], 2, scale=100)
    # minutes per DP run on the CPU, two runs sharing its 2 cores
    minutes = [r["history"][-1]["seconds"] / 60 for rs in runs.values() for r in rs]
    out |= fixed([min(minutes), max(minutes)], 0)
    # what one user with the average history adds to each of their items in the release: 1/√len
    out |= fixed([1 / math.sqrt(first["dataset"]["avg_len"])], 2)
    # learning curves of seed 0 (test) and the validation figures at epoch 20 the tuning used
    for k in CPU_RUNS:
        history = runs[k][0]["history"]
        out |= points([100 * h["test_ndcg@10"] for h in history])
        out |= fixed([history[-1]["valid_ndcg@10"]], 2, scale=100)
    harness = {opt: load(root, p)["hist"][-1] for opt, p in HARNESS.items()}
    out |= fixed([harness["adam"]["test"]] + [h["valid"] for h in harness.values()], 2, scale=100)
    return out | SETTINGS | PAPER


# --- the recipe for every model, at T = 50 and 200; larger ε; Re-Attention pairs --------------

MODELS = ("transformer-seqrec", "dpformer", "gru-seqrec", "lstm-seqrec", "transformer-seqrec-untied")
T200_RUNS = tuple(f"{BASE}/recipe_gpu/t200/runs/{m}_eps5_seed{s}.json" for m in MODELS for s in range(3))


@figures(
    "seqrec-recipe-models",
    files=(
        *(f"{BASE}/recipe_gpu/{f}/summary.json" for f in ("t50", "t200", "reattention_pairs")),
        *T200_RUNS,
        f"{BASE}/summary.json",
    ),
    command=SUMMARIZE,
)
def recipe_models(root: Path) -> set[str]:
    """Every model under the recipe at T = 200, the transformer at T = 50 and larger ε, the value of
    tying the embeddings, and the Re-Attention same-seed pairs."""
    t50, t200 = groups_of(root, "recipe_gpu/t50"), groups_of(root, "recipe_gpu/t200")
    out = points([group(t200, m)["ndcg@10_mean"] for m in MODELS]) | points([group(t50)["ndcg@10_mean"]])
    out |= mean_std(group(t200, "dpformer")) | mean_std(group(t200))
    for eps in (8.0, 10.0):  # ε = 8 and 10 at T = 50: NDCG@10 mean ± std and HIT@10's mean
        g = group(t50, epsilon=eps)
        out |= mean_std(g) | points([g["hit@10_mean"]])
    # the tied input embedding: transformer-seqrec − its untied twin, in points, at T = 50 and 200
    out |= fixed([group(t, TF)["ndcg@10_mean"] - group(t, f"{TF}-untied")["ndcg@10_mean"] for t in (t50, t200)], 1)
    # minutes per run at T = 200 (12 sharing the H100)
    minutes = [load(root, p)["history"][-1]["seconds"] / 60 for p in T200_RUNS]
    out |= fixed([min(minutes), max(minutes)], 1)
    # the GRU under the old protocol at T = 200 (20 epochs, §1)
    old = {(r["model"], r["epsilon"]): r for r in load(root, f"{BASE}/summary.json")["results"]}
    out |= points([old["gru-seqrec", 5.0]["ndcg@10_mean"]])
    # Re-Attention, same-seed pairs at T = 50 (shared noise) and T = 200: means ± stds, differences
    pairs = load(root, f"{BASE}/recipe_gpu/reattention_pairs/summary.json")
    out |= mean_std(group(pairs["groups"], "dpformer")) | mean_std(group(pairs["groups"]))
    for d in (
        pairs["dpformer_minus_transformer"]
        + load(root, f"{BASE}/recipe_gpu/t200/summary.json")["dpformer_minus_transformer"]
    ):
        out |= signed([d["ndcg@10_diff"]], 2)
    return out | SETTINGS


# --- the old protocol: 20 epochs (§1), 100 epochs on a GPU (§2) and on the CPU (§3) -----------

TRANSFORMERS = ("dpformer", "transformer-seqrec", "transformer-seqrec-untied")
RUNS20 = tuple(
    f"{BASE}/runs/{m}_eps{e}_lr{lr}_bs1024_seed{s}.json"
    for m in TRANSFORMERS
    for e, lr, s in ((5, 0.01, 0), (5, 0.01, 1), (5, 0.01, 2), (5, 0.003, 0), (8, 0.01, 0), (10, 0.01, 0))
)


@figures(
    "dpformer-20-epochs",
    files=(f"{BASE}/summary.json", *RUNS20),
    command="python benchmarks/reproduce_dpformer_ml1m.py --device cuda --epochs 20 --eval-every 5",
)
def twenty_epochs(root: Path) -> set[str]:
    """q and σ at ε = 5, and the range of every Transformer run's final test NDCG@10."""
    results = load(root, f"{BASE}/summary.json")["results"]
    (r5,) = [r for r in results if r["model"] == TF and r["epsilon"] == 5.0]
    finals = [final_test(load(root, p)) for p in RUNS20]
    return (
        fixed([r5["sample_rate"]], 2) | fixed([r5["noise_multiplier"]], 2) | points([min(finals), max(finals)]) | PAPER
    )


GPU100_RUNS = tuple(
    f"{GPU100}/runs/{m}_eps{e}_lr{lr}_bs{b}_seed{s}.json"
    for m in ("dpformer", TF)
    for e, lr, b, s in (
        *((5, 0.01, 1024, s) for s in range(3)),
        *((5, lr, b, 0) for lr in (0.003, 0.009) for b in (256, 4096)),
        (20, 0.01, 1024, 0),
        (100, 0.01, 1024, 0),
    )
)
FULL_GRID_RUNS = 125  # the full reproduction the prose sizes: 5 lr × 5 B × 5 models
SHARING = 8  # runs sharing one GPU in that estimate


@figures("dpformer-100-epochs", files=(f"{GPU100}/summary.json", *GPU100_RUNS), command=GPU100_COMMAND)
def hundred_epochs(root: Path) -> set[str]:
    """§2: DPFormer vs the vanilla Transformer over 100 epochs at T = 200, both without DP."""
    summary = load(root, f"{GPU100}/summary.json")
    groups = summary["groups"]
    lr_b = {"lr": 0.01, "batch_size": 1024}
    out = set()
    for eps in (5.0, 20.0):
        out |= mean_std(group(groups, "dpformer", eps, **lr_b)) | mean_std(group(groups, TF, eps, **lr_b))
    # the vanilla model at ε = 20, 100 and without DP at one decimal (ε = 100 also whole), and at two
    vanilla = [group(groups, TF, eps, **lr_b)["ndcg@10_mean"] for eps in (20.0, 100.0, None)]
    out |= (
        fixed(vanilla, 1)
        | fixed(vanilla[1:2], 0)
        | points([group(groups, "gru-seqrec", None)["ndcg@10_mean"], vanilla[-1]])
    )
    # at ε = 5, every (lr, B): the range of the means and the best seed
    at5 = [g for g in groups if g["epsilon"] == 5.0]
    means = [g["ndcg@10_mean"] for g in at5]
    out |= points([min(means), max(means), max(v for g in at5 for v in g["ndcg@10"])])
    # same-seed differences at the end (their size) and the largest gap between the curves
    diffs = summary["dpformer_minus_transformer"]
    out |= points([abs(d["ndcg@10_diff"]) for d in diffs] + [d["max_abs_curve_diff"] for d in diffs])
    out |= signed([d["ndcg@10_diff"] for d in diffs], 2)
    runs = {p: load(root, p) for p in GPU100_RUNS}
    # σ at ε = 20 and 100; the vanilla model's ε = 20 curve (seed 0)
    out |= fixed([r["noise_multiplier"] for r in runs.values() if r["epsilon_target"] in (20.0, 100.0)], 2)
    out |= points(
        [100 * h["test_ndcg@10"] for h in runs[f"{GPU100}/runs/{TF}_eps20_lr0.01_bs1024_seed0.json"]["history"]]
    )
    # wall time per run (to the nearest 10 s), and what the full grid would take 8 at a time
    walls = [r["wall_seconds"] for r in runs.values()]
    out |= {f"{round(min(walls), -1):.0f}", f"{round(max(walls), -1):.0f}"}
    out |= fixed([FULL_GRID_RUNS * max(walls) / SHARING / 3600], 1)
    return out


@figures(
    "dpformer-cpu-100-epochs",
    files=CPU_CURVES,
    command="dpzoo train dpformer --data ml-1m --epsilon 5 --epochs 100 --eval-every 10 --batch-size 1024",
)
def cpu_hundred_epochs(root: Path) -> set[str]:
    """§3: σ of the two 100-epoch CPU runs."""
    return fixed([load(root, p)["noise_multiplier"] for p in CPU_CURVES], 2)


# --- references (§4), the Re-Attention measurements (§5) --------------------------------------


@figures(
    "dpformer-nonprivate-20-epochs",
    files=CPU_NONPRIVATE,
    command="--non-private --epochs 20",
)
def nonprivate_twenty_epochs(root: Path) -> set[str]:
    """§4: the Transformer and the GRU after 120 steps without DP (T = 50)."""
    return points([final_test(load(root, p)) for p in CPU_NONPRIVATE])


@figures("dpformer-diagnostics", files=(DIAGNOSTICS, DIAGNOSTICS_EPS20), command="benchmarks/dpformer_diagnostics.py")
def diagnostics(root: Path) -> set[str]:
    """Popularity at T = 50 and 200, and what switching Re-Attention's correction off changes in
    DPFormers trained at ε = 5 and 20."""
    d5, d20 = load(root, DIAGNOSTICS), load(root, DIAGNOSTICS_EPS20)
    out = set()
    for n in (50, 200):
        test = d5["popularity"][f"max_len_{n}"]["test"]
        out |= fixed([test["ndcg@10"], test["hit@10"]], 2, scale=100)
    for d in (d5, d20):
        ra = d["reattention"]
        out |= fixed([d["model_test_same_len"]["ndcg@10"], *ra["ndcg@10_on_off"]], 2, scale=100)
        out |= fixed([ra["users_with_changed_top10"]], 0, scale=100)
        out |= fixed([ra["item_embedding_error_std"]["q100"]], 0)
    out |= fixed([d20["reattention"]["max_abs_logit_change"]], 2)
    # the median correction at ε = 5 over that at ε = 20; the ε = 20 model's training time in minutes
    corr = [d["reattention"]["score_correction"]["q50"] for d in (d5, d20)]
    out |= fixed([corr[0] / corr[1]], 0) | fixed([d20["training"]["wall_seconds"] / 60], 0)
    return out
