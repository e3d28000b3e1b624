"""Cost of watching the loss (grad_norms/sample_rows.py): one DP step with the batch and the
outputs tracked against the same step with tracking switched off, interleaved in one process.

    python benchmarks/bench_loss_guard.py --out benchmarks/results/loss_guard.json

Configs: a 4-layer GPT-2 (width 256, vocabulary 1024, batch 16 × 128, the causal-LM loss through
``labels=``), and a small MLP on 32 features (batch 64, cross-entropy), where the loss's Python
overhead weighs most. Ratio: the median over rounds of (tracked step / untracked step).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import dpzoo
import dpzoo.grad_norms.ghost as ghost
import dpzoo.privacy.data as data


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=1024, n_embd=256, n_layer=4, n_head=4, n_positions=128, bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, 1024, (256, 128))
    return GPT2LMHeadModel(cfg), TensorDataset(ids, ids.clone()), 16, lambda m, b: m(input_ids=b[0], labels=b[1]).loss


def mlp():
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 10))
    x, y = torch.randn(1024, 32), torch.randint(0, 10, (1024,))
    return model, TensorDataset(x, y), 64, lambda m, b: F.cross_entropy(m(b[0]), b[1])


def private(build):
    model, ds, batch, loss = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = dpzoo.PrivacyEngine().make_private(
            module=model, optimizer=opt, data_loader=DataLoader(ds, batch_size=batch), noise_multiplier=1.0,
            max_grad_norm=1.0, self_check=False,
        )  # fmt: skip
    return model, opt, loader, loss


def timed_step(model, opt, batches, loss) -> float:
    t0 = time.perf_counter()
    loss(model, next(batches)).backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - t0


def tracking(on: bool, saved: dict) -> None:
    """Switch the batch's and the outputs' tracking on or off (off: the tensors stay plain)."""
    ghost.track = saved["ghost"] if on else (lambda t, b, owned=None: t)
    data.track_batch = saved["data"] if on else (lambda batch, size: batch)


def run(build, rounds: int, steps: int) -> dict:
    saved = {"ghost": ghost.track, "data": data.track_batch}
    runs = {on: private(build) for on in (True, False)}
    its = {on: iter(_cycle(runs[on][2])) for on in runs}
    ratios = []
    for r in range(rounds):
        times = {}
        for on in (True, False) if r % 2 == 0 else (False, True):
            tracking(on, saved)
            model, opt, _, loss = runs[on]
            times[on] = statistics.median(timed_step(model, opt, its[on], loss) for _ in range(steps))
        ratios.append(times[True] / times[False])
    tracking(True, saved)
    return {"median": statistics.median(ratios), "low": min(ratios), "high": max(ratios), "per_round": ratios}


def _cycle(loader):
    while True:
        for b in loader:
            if len(b[0]):
                yield b


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/loss_guard.json")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    results = {name: run(build, args.rounds, args.steps) for name, build in (("gpt2-4x256", gpt2), ("mlp-32", mlp))}
    meta = {
        "command": "python benchmarks/bench_loss_guard.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
        "ratio": "median over rounds of (tracked step time / untracked step time), interleaved",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "configs": results}, indent=1) + "\n")
    for name, r in results.items():
        print(f"{name}: tracked / untracked step {r['median']:.3f} [{r['low']:.3f}–{r['high']:.3f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
