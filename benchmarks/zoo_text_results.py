"""The zoo cards' "DP results" of the language entries: each text classifier, causal LM and
encoder-decoder trained from scratch (its small configuration, vocabulary 256) on the bundled
docstring task of ``examples/dp_frost_minilm.py`` (the first sentences of Python standard-library
docstrings, 5 module families; the split of ``examples/dp_finetune_minilm_compare.py``: a fixed
permutation with seed 0, the first fifth for testing), at ε = 8, δ = 1e-5 (Poisson sampling, every
parameter DP-trained, mode "auto"), several runs (the noise is secret, so runs differ), beside one
run of the same configuration and recipe without DP (clipping and noise off, shuffled batches of the
expected batch size: the ceiling of that configuration on this data).

Tokens: the UTF-8 bytes of each sentence (a public, data-independent tokenizer), each sentence
alone truncated / padded to ``--seq-len`` bytes. One sentence is one sample (the privacy unit).

- text classifiers (``sequence-classification``): the sentence's family; test accuracy.
- causal LMs (``causal-lm``): next-byte prediction after a NUL start byte; test loss in bits per
  byte over every byte of the test sentences (lower is better; a uniform guess is 8 bits).
- encoder-decoder (``text2text-generation``): the sentence → its family as the target "<digit> EOS"
  (teacher forcing after the decoder's start token; the loss is the mean over those two tokens);
  test accuracy of the first decoder step's argmax over the 5 digit tokens.

Each entry's figures go to ``--out/ENTRY.json`` (the directory of ``benchmarks/zoo_results.py``);
``--write`` collects every entry's file there into ``dpzoo/models/dp_results.json`` (image and
language entries alike) and rewrites the cards under ``models/``.

    python benchmarks/zoo_text_results.py --write                      # every language entry
    python benchmarks/zoo_text_results.py gpt2 bert-base --runs 3 --write

Measured on the machine that runs it (CPU here). An entry that fails is reported and left out.
"""

from __future__ import annotations

import math
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples"), str(Path(__file__).resolve().parent)]

from dp_frost_minilm import FAMILIES, sentences  # noqa: E402 - the example's task, unchanged
from zoo_results import measure_entries, results_parser  # noqa: E402 - one results file for all entries

import dpzoo  # noqa: E402
from dpzoo.losses import SequenceCrossEntropy  # noqa: E402

KINDS = {"sequence-classification": "classifier", "causal-lm": "lm", "text2text-generation": "seq2seq"}
# the recipe (every kind): Adam, expected batch, epochs, learning rate, clipping bound
RECIPE = {"epochs": 20, "batch_size": 128, "lr": 3e-3, "max_grad_norm": 1.0}
DATA = "stdlib docstring sentences (5 families; examples/dp_frost_minilm.py)"
LABEL_BYTE = ord("0")  # t5's target: the family's digit, then EOS


def language_entries() -> list[str]:
    return [n for n in dpzoo.list_models() if dpzoo.model_card(n).task in KINDS]


def kind(name: str) -> str:
    return KINDS[dpzoo.model_card(name).task]


def encode(texts: list[str], seq_len: int, pad: int, start: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of each text alone: its UTF-8 bytes (after ``start`` if given), truncated, padded with ``pad``."""
    ids = torch.full((len(texts), seq_len), pad, dtype=torch.long)
    mask = torch.zeros((len(texts), seq_len), dtype=torch.long)
    for i, t in enumerate(texts):
        b = ([start] if start is not None else []) + list(t.encode("utf-8"))
        b = b[:seq_len]
        ids[i, : len(b)] = torch.tensor(b)
        mask[i, : len(b)] = 1
    return ids, mask


def split() -> tuple[list[str], list[int], list[str], list[int]]:
    """(train texts, train labels, test texts, test labels): dp_finetune_minilm_compare.py's split."""
    texts, labels = sentences()
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(0)).tolist()
    texts, labels = [texts[i] for i in order], [labels[i] for i in order]
    n_test = len(texts) // 5
    return texts[n_test:], labels[n_test:], texts[:n_test], labels[:n_test]


def build(name: str) -> torch.nn.Module:
    kwargs = {**dpzoo.model_card(name).test_overrides, "vocab_size": 256}
    if kind(name) == "classifier":
        kwargs["num_classes"] = len(FAMILIES)
    return dpzoo.load(name, **kwargs).train()


def datasets(name: str, model: torch.nn.Module, seq_len: int) -> tuple[TensorDataset, TensorDataset]:
    """(train, test) of (input ids, attention mask, target) for ``name``'s kind."""
    tr_x, tr_y, te_x, te_y = split()
    out = []
    for texts, labels in ((tr_x, tr_y), (te_x, te_y)):
        if kind(name) == "lm":  # NUL (absent from the text) starts each sentence; padding is never a target
            ids, mask = encode(texts, seq_len, 0, start=0)
            out.append(TensorDataset(ids, mask, ids.masked_fill(mask == 0, -100)))
            continue
        ids, mask = encode(texts, seq_len, model.config.pad_token_id)
        y = torch.tensor(labels)
        if kind(name) == "seq2seq":
            start, eos = model.config.decoder_start_token_id, model.config.eos_token_id
            y = torch.stack([torch.full_like(y, start), y + LABEL_BYTE, torch.full_like(y, eos)], 1)
        out.append(TensorDataset(ids, mask, y))
    return out[0], out[1]


def batch_loss(name: str, model, ids, mask, y) -> torch.Tensor:
    """The mean over the batch of each sample's own loss (its tokens' mean for sequences)."""
    if kind(name) == "classifier":
        return F.cross_entropy(model(input_ids=ids, attention_mask=mask).logits, y)
    if kind(name) == "lm":
        return SequenceCrossEntropy(shift=True, token_reduction="mean")(model(input_ids=ids).logits, y)
    return SequenceCrossEntropy(token_reduction="mean")(seq2seq_logits(model, ids, mask, y), y[:, 1:])


def seq2seq_logits(model, ids, mask, y) -> torch.Tensor:
    """Teacher forcing: ``y`` is (start, digit, EOS); the decoder reads its first two, predicts its last two."""
    return model(input_ids=ids, attention_mask=mask, decoder_input_ids=y[:, :-1]).logits


@torch.no_grad()
def evaluate(name: str, model, test: TensorDataset) -> float:
    """Test accuracy, or for a causal LM the test loss in bits per byte."""
    model.eval()
    right = nll = count = 0.0
    for ids, mask, y in DataLoader(test, batch_size=256):
        if kind(name) == "classifier":
            right += (model(input_ids=ids, attention_mask=mask).logits.argmax(-1) == y).sum().item()
        elif kind(name) == "lm":
            logits = model(input_ids=ids).logits[:, :-1]
            nll += F.cross_entropy(logits.flatten(0, 1), y[:, 1:].flatten(), ignore_index=-100, reduction="sum").item()
            count += (y[:, 1:] != -100).sum().item()
        else:
            first = seq2seq_logits(model, ids, mask, y)[:, 0, LABEL_BYTE : LABEL_BYTE + len(FAMILIES)]
            right += (first.argmax(-1) + LABEL_BYTE == y[:, 1]).sum().item()
    model.train()
    return nll / count / math.log(2) if kind(name) == "lm" else right / len(test)


def run(name: str, seed: int, epsilon: float | None, seq_len: int, delta: float = 1e-5) -> dict:
    """One training run (DP at ``epsilon``, or without DP for None): its metric, steps, ε and seconds."""
    torch.manual_seed(seed)
    t = time.perf_counter()
    model = build(name)
    train, test = datasets(name, model, seq_len)
    opt = torch.optim.Adam(model.parameters(), lr=RECIPE["lr"])
    loader = DataLoader(train, batch_size=RECIPE["batch_size"], shuffle=epsilon is None)
    engine = None
    if epsilon is not None:
        engine = dpzoo.PrivacyEngine(accountant="rdp")
        model, opt, loader = engine.make_private(
            module=model,
            optimizer=opt,
            data_loader=loader,
            target_epsilon=epsilon,
            target_delta=delta,
            epochs=RECIPE["epochs"],
            max_grad_norm=RECIPE["max_grad_norm"],
            mode="auto",
            poisson_sampling=True,
        )
    steps = 0
    for _ in range(RECIPE["epochs"]):
        for ids, mask, y in loader:
            if len(y):  # an empty Poisson batch: the engine takes a noise-only step
                batch_loss(name, model, ids, mask, y).backward()
            opt.step()
            opt.zero_grad()
            steps += 1
    out = {"metric": evaluate(name, model, test), "steps": steps, "seconds": time.perf_counter() - t}
    out["params"] = sum(p.numel() for p in model.parameters())
    if engine is not None:
        out |= {"epsilon": engine.get_epsilon(delta), "noise_multiplier": engine.noise_multiplier}
    return out


def entry_result(name: str, runs: int, epsilon: float, seq_len: int) -> dict:
    """``runs`` DP runs of ``name`` (seeds 0.. for the initialisation) and one without DP (seed 0)."""
    dp = [run(name, seed, epsilon, seq_len) for seed in range(runs)]
    ceiling = run(name, 0, None, seq_len)
    values = [r["metric"] for r in dp]
    lm = kind(name) == "lm"
    metric = "test_bits_per_byte" if lm else "test_accuracy"
    tr, _, te, te_labels = split()
    card = dpzoo.model_card(name)
    overrides = {
        **card.test_overrides,
        "vocab_size": 256,
        **({"num_classes": len(FAMILIES)} if kind(name) == "classifier" else {}),
    }
    config = ("small: " if card.test_overrides else "its default (no smaller one; already tiny): ") + ", ".join(
        f"{k}={v}" for k, v in overrides.items()
    )
    return {
        "model": name,
        "kind": kind(name),
        "data": DATA,
        "train_size": len(tr),
        "test_size": len(te),
        "tokens": f"UTF-8 bytes, each sentence alone, {seq_len} bytes",
        "configuration": config,
        "parameters": dp[0]["params"],
        "epsilon": round(max(r["epsilon"] for r in dp), 3),
        "delta": 1e-5,
        "accountant": "rdp",
        "noise_multiplier": round(dp[0]["noise_multiplier"], 4),
        "optimizer": "adam",
        "lr": RECIPE["lr"],
        "max_grad_norm": RECIPE["max_grad_norm"],
        "epochs": RECIPE["epochs"],
        "batch_size": RECIPE["batch_size"],
        "steps": dp[0]["steps"],
        "runs": runs,
        "metric": metric,
        f"{metric}_mean": round(statistics.mean(values), 4),
        f"{metric}_min": round(min(values), 4),
        f"{metric}_max": round(max(values), 4),
        f"non_private_{metric}": round(ceiling["metric"], 4),
        **({"uniform_bits_per_byte": 8.0} if lm else {"chance_accuracy": round(1 / len(FAMILIES), 4)}),
        # the share of the test sentences in their most frequent family: what always guessing it scores
        **({} if lm else {"majority_test_accuracy": round(max(map(te_labels.count, set(te_labels))) / len(te), 4)}),
        "command": f"python benchmarks/zoo_text_results.py {name}",
        "seconds_per_run": round(statistics.mean(r["seconds"] for r in dp), 1),
        "non_private_seconds": round(ceiling["seconds"], 1),
        "measured": {
            "date": date.today().isoformat(),
            "machine": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = results_parser(__doc__.split("\n\n")[0], "every language entry")
    p.add_argument("--seq-len", type=int, default=64, help="bytes per sentence (default: 64)")
    p.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (default: 1; a shared CPU thrashes on more)"
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    def describe(r: dict) -> str:
        m = r["metric"]
        return (f"{m} {r[m + '_mean']:.3f} [{r[m + '_min']:.3f}, {r[m + '_max']:.3f}] at ε = {r['epsilon']} "
                f"(non-private {r['non_private_' + m]:.3f}), {r['steps']} steps, {r['seconds_per_run']} s per run")  # fmt: skip

    measure = lambda name: entry_result(name, args.runs, args.epsilon, args.seq_len)  # noqa: E731
    # any failure of one entry is reported and the others go on
    return measure_entries(args.entries or language_entries(), measure, describe, args.out, args.write, (Exception,))


if __name__ == "__main__":
    raise SystemExit(main())
