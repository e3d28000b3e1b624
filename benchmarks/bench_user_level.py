"""Cost of per-user clipping (dpzoo.grad_norms.units) against per-example clipping, interleaved
in one process: the same forward/backward of a batch, then its norms and clipped sum, once per
example and once per user of k examples (the rows of a user summed before the norm).

    python benchmarks/bench_user_level.py --out benchmarks/results/user_level

Config: a 4-layer GPT-2 (width 256, vocabulary 1024, T = 128), 16 sequences, k = 4 sequences per
user, hooks in ``"ghost"`` (ghost norm on every layer) and ``"auto"`` (BK-MixOpt: ghost norm or
instantiation per layer, by the planner's cost model). A user's ghost norm is the Gram matrix
of all its k·T positions, k times a row's work; instantiation costs the same per user as per
example. Timed: the norms and the clipped sum only (the backward is the same for both), median
over rounds. Writes ``user_level.json`` and ``user_level.png``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from dpzoo.grad_norms import attach_norm_hooks


def gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=1024, n_embd=256, n_layer=4, n_head=4, n_positions=128, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).eval()


def norm_and_sum_seconds(model, mode: str, ids: torch.Tensor, groups: torch.Tensor | None) -> float:
    """Seconds of one step's norms and clipped sum (after an untimed forward and backward)."""
    hooks = attach_norm_hooks(model, mode=mode)
    try:
        logits = model(input_ids=ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
        hooks.backward(loss)
        t0 = time.perf_counter()
        if groups is not None:
            hooks.group_rows(groups)
        norms = hooks.per_sample_norms()
        hooks.clipped_sum((1.0 / norms.clamp_min(1.0)).detach())
        return time.perf_counter() - t0
    finally:
        hooks.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/user_level", help="output folder (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default: %(default)s)")
    parser.add_argument("--k", type=int, default=4, help="examples per user (default: %(default)s)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = gpt2()
    ids = torch.randint(0, 1024, (16, 128), generator=torch.Generator().manual_seed(1))
    users = torch.arange(16) // args.k
    cells = [(mode, unit) for mode in ("ghost", "auto") for unit in ("example", "user")]
    times: dict = {f"{m}/{u}": [] for m, u in cells}
    for m, u in cells:  # warm-up
        norm_and_sum_seconds(model, m, ids, users if u == "user" else None)
    for _ in range(args.rounds):
        for m, u in cells:
            times[f"{m}/{u}"].append(norm_and_sum_seconds(model, m, ids, users if u == "user" else None))
    median = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "config": {"model": "gpt2 4x256, vocab 1024", "batch": 16, "seq_len": 128, "examples_per_user": args.k},
        "what": "seconds of the norms and the clipped sum of one step, median over interleaved rounds",
        "seconds": median,
        "ratios": {
            "ghost: per user / per example": median["ghost/user"] / median["ghost/example"],
            "auto: per user / per example": median["auto/user"] / median["auto/example"],
            "auto per user / ghost per example": median["auto/user"] / median["ghost/example"],
        },
        "rounds": args.rounds,
        "machine": f"{torch.get_num_threads()} threads, {platform.machine()}",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "user_level.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(median, out / "user_level.png")
    print(json.dumps(result["ratios"], indent=2))


def plot(median: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(list(median), [v * 1e3 for v in median.values()], color=["#4c72b0", "#dd8452"] * 2)
    ax.set_ylabel("norms + clipped sum (ms)")
    ax.set_title("per-example vs per-user clipping (k = 4), GPT-2 4x256, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
