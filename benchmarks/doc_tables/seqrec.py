"""The tables of docs/RESULTS.md on DP next-item recommendation on MovieLens-1M (the sections "DP
next-item recommendation at ε = 5: the recipe (issue 17)" and "DPFormer on MovieLens-1M (issue 5)"),
rendered from the runs committed under benchmarks/results/dpformer_ml1m/.

Means, stds and per-seed values come from the ``summary.json`` that
``benchmarks/summarize_seqrec_runs.py`` (or ``benchmarks/reproduce_dpformer_ml1m.py`` for §1)
wrote beside each folder's runs; learning curves, σ and the exploration runs from the runs' own
JSON; the popularity baseline and the Re-Attention measurements from
``benchmarks/dpformer_diagnostics.py``'s JSON. The paper's figures are ``PAPER_EPS5`` of
``benchmarks/reproduce_dpformer_ml1m.py`` (DPFormer paper, Table 1, MovieLens-1M, ε = 5).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from reproduce_dpformer_ml1m import PAPER_EPS5  # DPFormer paper Table 1, ML-1M, ε = 5: (NDCG@10 %, HIT@10 %)

from doc_tables import table

BASE = "benchmarks/results/dpformer_ml1m"
DIAGNOSTICS = f"{BASE}/cpu/diagnostics.json"  # its "popularity" holds the baseline at T = 50 and 200
DIAGNOSTICS_EPS20 = f"{BASE}/cpu/diagnostics_eps20.json"
GPU100 = f"{BASE}/gpu100"
EXPLORATION = f"{BASE}/recipe_cpu/exploration"
CPU_CURVES = tuple(f"{BASE}/cpu/dp_{m}_eps5_T50_ep100_seed0.json" for m in ("dpformer", "transformer-seqrec"))
CPU_NONPRIVATE = tuple(f"{BASE}/cpu/nonprivate_{m}_T50_ep20.json" for m in ("transformer-seqrec", "gru-seqrec"))


# --- reading and formatting -------------------------------------------------------------------


def read(root: Path, path: str) -> dict:
    return json.loads((root / path).read_text())


def summary(root: Path, folder: str) -> list[dict]:
    """The groups (one per model, ε, lr, B) of a folder's summary.json."""
    return read(root, f"{BASE}/{folder}/summary.json")["groups"]


def group(groups: list[dict], model: str = "transformer-seqrec", epsilon: float | None = 5.0) -> dict:
    (g,) = [g for g in groups if g["model"] == model and g["epsilon"] == epsilon]
    return g


def mean_std(g: dict, metric: str) -> str:
    """``4.93 ± 0.09`` over seeds, the bare value for one seed."""
    if len(g["seeds"]) == 1:
        return f"{g[metric + '_mean']:.2f}"
    return f"{g[metric + '_mean']:.2f} ± {g[metric + '_std']:.2f}"


def per_seed(g: dict, gpu_folder: bool = False) -> str:
    """Each seed's NDCG@10; in a GPU folder, a seed that ran on the CPU says so."""
    devices = g.get("devices") or [None] * len(g["seeds"])
    return ", ".join(
        f"{v:.2f}" + (" (CPU)" if gpu_folder and d == "cpu" else "") for v, d in zip(g["ndcg@10"], devices)
    )


def popularity(root: Path, max_len: int) -> tuple[str, str]:
    """Test NDCG@10 and HIT@10 (%) of the popularity ranking with length-``max_len`` histories."""
    test = read(root, DIAGNOSTICS)["popularity"][f"max_len_{max_len}"]["test"]
    return f"{100 * test['ndcg@10']:.2f}", f"{100 * test['hit@10']:.2f}"


def italic(text: str) -> str:
    return f"*{text}*" if text else text


def lr_text(lr: float) -> str:
    """``1e-2`` for 0.01."""
    mantissa, exponent = f"{lr:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def row(*cells) -> str:
    return "|" + "|".join(f" {c} " if c != "" else " " for c in cells) + "|"


def header(*columns: str) -> list[str]:
    return [row(*columns), "|" + "---|" * len(columns)]


def paper(model: str) -> str:
    ndcg, hit = PAPER_EPS5[model]
    return f"{ndcg:.2f} / {hit:.2f}"


# --- issue 17: the recipe ---------------------------------------------------------------------

ABLATION = (  # (configuration, folder under BASE): 3 seeds each, transformer-seqrec at ε = 5
    ("recipe: private prior, no dropout", "recipe_cpu/recipe"),
    ("exact counts outside ε (`--item-prior public`), no dropout", "recipe_gpu/public"),
    ("no prior (`--item-prior none`), no dropout", "recipe_gpu/noprior"),
    ("private prior, dropout 0.2", "recipe_cpu/dropout02"),
    ("exact counts outside ε, dropout 0.2", "recipe_gpu/public_dropout02"),
    ("no prior, dropout 0.2 (the old default, positions fixed)", "recipe_gpu/noprior_dropout02"),
)
HARNESS = (  # (configuration, file under EXPLORATION): one seed each, harness.py's JSON
    ("harness: exact counts as log(c + 1), dropout 0.2", "adam_public_counts_dropout02_seed0.json"),
    (
        "harness: same, SGD momentum 0.9 lr 0.5 instead of Adam",
        "sgd_lr0.5_momentum0.9_public_counts_dropout02_seed0.json",
    ),
)
D_MODEL32 = f"{EXPLORATION}/d_model32_dropout02_seed0_stopped_at_epoch15.csv"
D_MODEL64 = f"{BASE}/recipe_cpu/dropout02/runs/transformer-seqrec_eps5_seed0.json"  # the same run at d 64
NONPRIVATE = "recipe_cpu/nonprivate_reference"


def folder_cell(folder: str) -> str:
    gpu = folder.startswith("recipe_gpu/")
    return f"GPU `{folder.removeprefix('recipe_gpu/')}/`" if gpu else f"`{folder}/`"


def ablation_row(root: Path, label: str, folder: str) -> str:
    g = group(summary(root, folder))
    ndcg = mean_std(g, "ndcg@10")
    ndcg = f"**{ndcg}**" if folder == "recipe_cpu/recipe" else ndcg
    gpu = folder.startswith("recipe_gpu/")
    return row(label, len(g["seeds"]), ndcg, mean_std(g, "hit@10"), per_seed(g, gpu), folder_cell(folder))


def harness_row(root: Path, label: str, name: str) -> str:
    last = read(root, f"{EXPLORATION}/{name}")["hist"][-1]
    ndcg = f"{100 * last['test']:.2f}"
    return row(label, 1, ndcg, f"{100 * last['test_hit']:.2f}", ndcg, "`recipe_cpu/exploration/`")


def d_model32_row(root: Path) -> str:
    """The d_model 32 run, stopped early, beside the d_model 64 run at the same epoch."""
    last = list(csv.DictReader((root / D_MODEL32).read_text().splitlines()))[-1]
    epoch = int(last["epoch"])
    (d64,) = [h for h in read(root, D_MODEL64)["history"] if h["epoch"] == epoch]
    ndcg = f"{100 * float(last['test_ndcg@10']):.2f} at epoch {epoch} (d 64: {100 * d64['test_ndcg@10']:.2f})"
    label = f"private prior, d_model 32, dropout 0.2 (stopped at epoch {epoch})"
    return row(label, 1, ndcg, "", "", "`recipe_cpu/exploration/`")


def nonprivate_row(root: Path) -> str:
    g = group(summary(root, NONPRIVATE), epsilon=None)
    label = "non-private, same settings (exact prior, no dropout; `--non-private`)"
    cells = (italic(label), len(g["seeds"]), italic(mean_std(g, "ndcg@10")), italic(mean_std(g, "hit@10")))
    return row(*cells, per_seed(g), folder_cell(NONPRIVATE))


@table(
    "seqrec-ablation",
    files=(
        *(f"{BASE}/{folder}/summary.json" for _, folder in ABLATION),
        f"{BASE}/{NONPRIVATE}/summary.json",
        *(f"{EXPLORATION}/{name}" for _, name in HARNESS),
        D_MODEL32,
        D_MODEL64,
        DIAGNOSTICS,
    ),
    command="dpzoo train transformer-seqrec --data ml-1m --epsilon 5 --max-len 50",
)
def ablation(root: Path) -> str:
    lines = header("configuration", "seeds", "test NDCG@10", "HIT@10", "per seed", "folder")
    lines += [ablation_row(root, label, folder) for label, folder in ABLATION]
    lines += [harness_row(root, label, name) for label, name in HARNESS]
    lines += [d_model32_row(root), nonprivate_row(root)]
    ndcg, hit = popularity(root, 50)
    lines.append(row(italic("popularity ranking (T = 50 history)"), "", italic(ndcg), italic(hit), "", ""))
    return "\n".join(lines)


MODELS = ("transformer-seqrec", "dpformer", "gru-seqrec", "lstm-seqrec", "transformer-seqrec-untied")
LABELS = {"dpformer": "dpformer (Re-Attention)"}


@table(
    "seqrec-models-by-length",
    files=(f"{BASE}/recipe_gpu/t50/summary.json", f"{BASE}/recipe_gpu/t200/summary.json", DIAGNOSTICS),
    command="python benchmarks/summarize_seqrec_runs.py",
)
def models_by_length(root: Path) -> str:
    """Every model under the recipe at ε = 5, at length 50 and 200; the best at 200 in bold."""
    t50, t200 = summary(root, "recipe_gpu/t50"), summary(root, "recipe_gpu/t200")
    best = max(MODELS, key=lambda m: group(t200, m)["ndcg@10_mean"])
    lines = header(
        "model", "T = 50: NDCG@10", "HIT@10", "T = 200: NDCG@10", "HIT@10", "paper (T = 200) NDCG@10 / HIT@10"
    )
    for m in MODELS:
        a, b = group(t50, m), group(t200, m)
        ndcg200 = mean_std(b, "ndcg@10")
        ndcg200 = f"**{ndcg200}**" if m == best else ndcg200
        cells = (mean_std(a, "ndcg@10"), mean_std(a, "hit@10"), ndcg200, mean_std(b, "hit@10"), paper(m))
        lines.append(row(LABELS.get(m, m), *cells))
    pops = [italic(v) for n in (50, 200) for v in popularity(root, n)]
    lines.append(row(italic("popularity"), *pops, ""))
    return "\n".join(lines)


# --- issue 5: DPFormer under the old protocol ------------------------------------------------

SECTION1_MODELS = ("dpformer", "transformer-seqrec", "transformer-seqrec-untied", "gru-seqrec", "lstm-seqrec")


@table(
    "dpformer-ml1m-20-epochs",
    files=(f"{BASE}/summary.json", DIAGNOSTICS),
    command="python benchmarks/reproduce_dpformer_ml1m.py --device cuda --epochs 20 --eval-every 5",
)
def twenty_epochs(root: Path) -> str:
    """§1: the five models at ε = 5 (mean ± std over seeds), 8 and 10 (one seed), T = 200."""
    results = read(root, f"{BASE}/summary.json")["results"]
    by = {(r["model"], r["epsilon"]): r for r in results}
    (seeds,) = {r["seeds"] for r in results if r["epsilon"] == 5}
    lines = header("model", f"ε = 5 NDCG@10 ({seeds} seeds)", "ε = 5 HIT@10", "ε = 8", "ε = 10", "paper, ε = 5")
    for m in SECTION1_MODELS:
        r5 = by[m, 5.0]
        cells = [
            f"{r5['ndcg@10_mean']:.2f} ± {r5['ndcg@10_std']:.2f}",
            f"{r5['hit@10_mean']:.2f} ± {r5['hit@10_std']:.2f}",
        ]
        cells += [f"{by[m, e]['ndcg@10_mean']:.2f} / {by[m, e]['hit@10_mean']:.2f}" for e in (8.0, 10.0)]
        lines.append(row(m, *cells, paper(m)))
    ndcg, hit = popularity(root, 200)
    lines.append(row(italic("popularity ranking"), italic(ndcg), italic(hit), "", "", ""))
    return "\n".join(lines)


GPU100_SETTINGS = ((5.0, 1024), (5.0, 256), (5.0, 4096), (20.0, 1024), (100.0, 1024), (None, 1024))  # (ε, B)
GPU100_MODELS = ("dpformer", "transformer-seqrec", "gru-seqrec")
GPU100_RUNS = (  # the seed-0 runs whose JSON gives each row's σ (the summary does not keep it)
    *(
        f"{GPU100}/runs/{m}_eps{e}_lr{lr}_bs{b}_seed0.json"
        for e, lr, b in ((5, 0.01, 1024), (5, 0.003, 256), (5, 0.009, 256), (5, 0.003, 4096), (5, 0.009, 4096))
        + ((20, 0.01, 1024), (100, 0.01, 1024))
        for m in ("dpformer", "transformer-seqrec")
    ),
    *(f"{GPU100}/nonprivate/{m}.json" for m in ("transformer-seqrec", "gru-seqrec")),
)


def sigma_text(root: Path, g: dict) -> str:
    """σ of DP-SGD from the group's first run file (rounded as the document prints it)."""
    if g["epsilon"] is None:
        return "0"
    return str(round(read(root, f"{GPU100}/runs/{g['sources'][0]}")["noise_multiplier"], 2))


def gpu100_row(root: Path, gs: list[dict]) -> str:
    """One model at one (ε, B): its learning rates side by side (``a / b``) when more than one."""
    first = gs[0]
    eps = "non-private" if first["epsilon"] is None else f"{first['epsilon']:g}"
    cells = [" / ".join(lr_text(g["lr"]) for g in gs), first["batch_size"], len(first["seeds"])]
    cells += [" / ".join(mean_std(g, metric) for g in gs) for metric in ("ndcg@10", "hit@10")]
    seeds = per_seed(first) if len(gs) == 1 and len(first["seeds"]) > 1 else ""
    return row(first["model"], eps, sigma_text(root, first), *cells, seeds)


@table(
    "dpformer-ml1m-100-epochs",
    files=(f"{GPU100}/summary.json", *GPU100_RUNS, DIAGNOSTICS),
    command="python benchmarks/summarize_seqrec_runs.py benchmarks/results/dpformer_ml1m/gpu100",
)
def hundred_epochs(root: Path) -> str:
    """§2: dpformer vs transformer-seqrec over 100 epochs at T = 200, and both without DP."""
    groups = read(root, f"{GPU100}/summary.json")["groups"]
    lines = header("model", "ε", "σ", "lr", "B", "seeds", "NDCG@10", "HIT@10", "per seed NDCG@10")
    shown = 0
    for eps, bs in GPU100_SETTINGS:
        for m in GPU100_MODELS:
            gs = sorted(
                (g for g in groups if (g["model"], g["epsilon"], g["batch_size"]) == (m, eps, bs)),
                key=lambda g: g["lr"],
            )
            if gs:
                lines.append(gpu100_row(root, gs))
                shown += len(gs)
    if shown != len(groups):
        raise ValueError(f"{GPU100}/summary.json has runs at settings the table does not show")
    ndcg, hit = popularity(root, 200)
    lines.append(row(italic("popularity ranking"), "", "", "", "", "", italic(ndcg), italic(hit), ""))
    return "\n".join(lines)


@table(
    "dpformer-ml1m-cpu-curves",
    files=(*CPU_CURVES, DIAGNOSTICS),
    command="dpzoo train dpformer --data ml-1m --epsilon 5 --epochs 100 --eval-every 10 --batch-size 1024",
)
def cpu_curves(root: Path) -> str:
    """§3: test NDCG@10 at every evaluation, the last in bold with its validation value."""
    runs = [read(root, path) for path in CPU_CURVES]
    epochs = [h["epoch"] for h in runs[0]["history"]]
    lines = header("epoch", *map(str, epochs), f"HIT@10 at {epochs[-1]}")
    for r in runs:
        *early, last = r["history"]
        cells = [f"{100 * h['test_ndcg@10']:.2f}" for h in early]
        cells.append(f"**{100 * last['test_ndcg@10']:.2f}** ({100 * last['valid_ndcg@10']:.2f})")
        lines.append(row(r["model"], *cells, f"{100 * last['test_hit@10']:.2f}"))
    ndcg, hit = popularity(root, 50)
    blanks = [""] * (len(epochs) - 1)
    lines.append(row(italic("popularity, length-50 history"), *blanks, italic(ndcg), italic(hit)))
    return "\n".join(lines)


@table(
    "seqrec-nonprivate-t50",
    files=CPU_NONPRIVATE,
    command="--data ml-1m --non-private --epochs 20 --eval-every 5 --batch-size 1024 --lr 1e-2 --max-len 50",
)
def nonprivate_t50(root: Path) -> str:
    """§4: the first 20 epochs without DP at T = 50, NDCG@10 / HIT@10 at every evaluation."""
    runs = [read(root, path) for path in CPU_NONPRIVATE]
    first = runs[0]
    epochs = [h["epoch"] for h in first["history"]]
    title = f"without DP, T = {first['max_len']}, lr {lr_text(first['lr'])}, B = {first['batch_size']}"
    lines = header(title, f"after {epochs[0]} epochs", *map(str, epochs[1:]))
    for r in runs:
        cells = [f"{100 * h['test_ndcg@10']:.2f} / {100 * h['test_hit@10']:.2f}" for h in r["history"]]
        lines.append(row(r["model"], *cells))
    return "\n".join(lines)


def reattention_row(root: Path, path: str) -> str:
    """One trained DPFormer's Re-Attention measurements (``dpformer_diagnostics.py``'s JSON)."""
    d = read(root, path)
    training = d["training"].get("privacy", d["training"])  # a --model run keeps the model's privacy metadata
    pop = d["popularity"][f"max_len_{d['settings']['max_len']}"]["test"]["ndcg@10"]
    label = (
        f"ε = {d['settings']['epsilon']:g} (σ = {training['noise_multiplier']:.2f}; "
        f"model {100 * d['model_test_same_len']['ndcg@10']:.2f}%, popularity {100 * pop:.2f}%)"
    )
    ra = d["reattention"]
    err, corr = ra["item_embedding_error_std"], ra["score_correction"]
    return row(
        label,
        f"{err['q50']:.3g} / {err['q90']:.3g} / {err['q100']:.3g}",
        f"{corr['q50']:.3g} / {corr['q90']:.3g} / {corr['q99']:.3g} / {corr['q100']:.2g}",
        f"{ra['max_abs_logit_change']:.2f}",
        f"{100 * ra['users_with_changed_top10']:.0f}%",
        f"{100 * ra['users_with_changed_target_rank']:.0f}%",
        " / ".join(f"{100 * v:.2f}" for v in ra["ndcg@10_on_off"]),
    )


@table(
    "dpformer-reattention-size",
    files=(DIAGNOSTICS, DIAGNOSTICS_EPS20),
    command="python benchmarks/dpformer_diagnostics.py",
)
def reattention_size(root: Path) -> str:
    """§5: the size of the Re-Attention correction in DPFormers trained at ε = 5 and 20."""
    lines = header(
        "DPFormer trained at (test NDCG@10)",
        "item-embedding error std: median / 90% / max",
        "correction C·σ_k²/2: median / 90% / 99% / max",
        "largest logit change, on vs off",
        "users whose top-10 changes",
        "whose target's rank changes",
        "NDCG@10, correction on / off",
    )
    lines += [reattention_row(root, path) for path in (DIAGNOSTICS, DIAGNOSTICS_EPS20)]
    return "\n".join(lines)
