"""DP training of a small GPT-2 (tied embeddings, Phantom Clipping) on local text.

No pretrained GPT-2 or text dataset is reachable offline, so this trains a byte-level GPT-2
(vocabulary 256, 2 layers) on the docstrings of Python's standard library, one 64-byte
sequence per sample (the privacy unit), and prints the held-out loss before and after and
the ε spent.

    python examples/dp_gpt2_text.py [--epochs 2] [--epsilon 8]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import dpzoo
from dpzoo.losses import SequenceCrossEntropy

MODULES = [
    "argparse",
    "json",
    "pathlib",
    "collections",
    "functools",
    "itertools",
    "re",
    "string",
    "textwrap",
    "datetime",
    "statistics",
    "random",
    "csv",
    "logging",
    "unittest",
    "typing",
]


def corpus(seq_len: int) -> torch.Tensor:
    text = []
    for name in MODULES:
        mod = importlib.import_module(name)
        for _, obj in inspect.getmembers(mod):
            doc = inspect.getdoc(obj) if (inspect.isfunction(obj) or inspect.isclass(obj)) else None
            if doc:
                text.append(doc)
    data = torch.tensor(list("\n\n".join(text).encode("utf-8")), dtype=torch.long)
    n = len(data) // seq_len
    return data[: n * seq_len].view(n, seq_len)


@torch.no_grad()
def mean_loss(model, seqs):
    crit = SequenceCrossEntropy(shift=True, token_reduction="mean", reduction="mean")
    model.eval()
    loss = crit(model(input_ids=seqs).logits, seqs).item()
    model.train()
    return loss


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--epsilon", type=float, default=8.0)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--seq-len", type=int, default=64)
    args = ap.parse_args()
    torch.manual_seed(0)
    seqs = corpus(args.seq_len)
    perm = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(0))
    test, train = seqs[perm[:256]], seqs[perm[256:]]
    model = dpzoo.load(
        "gpt2",
        vocab_size=256,
        num_layers=2,
        width=128,
        num_heads=4,
        max_positions=args.seq_len,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    ).train()
    print(
        f"{len(train):,} training sequences of {args.seq_len} bytes; tied: "
        f"{' = '.join(model.dpzoo_patch_report.tied_groups[0].names)}"
    )
    print(f"held-out loss before: {mean_loss(model, test):.3f} nats/byte (uniform: {math.log(256):.3f})")
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    engine = dpzoo.PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(TensorDataset(train), batch_size=128),
        target_epsilon=args.epsilon,
        target_delta=args.delta,
        epochs=args.epochs,
        max_grad_norm=1.0,
        clipping="automatic",
        mode="bk-mixopt",
        max_physical_batch_size=64,
    )
    crit = SequenceCrossEntropy(shift=True, token_reduction="mean")
    t = time.time()
    for epoch in range(args.epochs):
        for (x,) in loader:
            if x.shape[0]:
                crit(model(input_ids=x).logits, x).backward()
            opt.step()
            opt.zero_grad()
        print(
            f"epoch {epoch + 1}: held-out loss {mean_loss(model, test):.3f}  epsilon {engine.get_epsilon():.2f}  "
            f"({time.time() - t:.0f}s)"
        )
    print(
        f"spent epsilon {engine.get_epsilon():.2f} at delta {args.delta:g} "
        f"(sigma {engine.noise_multiplier:.3f}, {engine.steps} steps, accountant {engine.accountant.name})"
    )


if __name__ == "__main__":
    main()
