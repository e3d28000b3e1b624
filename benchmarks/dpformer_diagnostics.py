"""Why does DPFormer score like the vanilla DP Transformer here? Measurements for docs/RESULTS.md.

1. **Popularity baseline**: rank every item by how many training sequences contain it, with the
   same protocol as training (all items, history excluded). A DP Transformer that has learned
   little beyond item popularity scores close to this.
2. **Size of the Re-Attention correction** in a dpformer trained privately with the reproduction's
   settings (ε, batch size, epochs and so σ_dp as in docs/RESULTS.md; shorter sequences so a CPU
   can train it): the effective error of the item embeddings (σ_dp/(B·p_i), Claim 5.4), the
   attention-score corrections C·σ_i²/2 that Re-Attention subtracts, and what they change in
   the final ranking (the same weights scored with Re-Attention on and off).

    python benchmarks/dpformer_diagnostics.py --data ml-1m --data-dir ../shared/data --out benchmarks/results/dpformer_ml1m/diagnostics.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from dpzoo.hub.load_save import load, privacy_metadata
from dpzoo.seqrec import reattention as ep
from dpzoo.seqrec.metrics import ndcg_hit_at_k, target_ranks
from dpzoo.seqrec.train import evaluate, get_dataset, train_seqrec


def popularity(ds, max_len: int) -> dict:
    x, _ = ds.to_padded(max_len, "train")
    counts = torch.zeros(ds.num_items + 1)
    for row in x:  # sequences containing the item (the p_i of Claim 5.4), not raw counts
        counts[row.unique()] += 1
    counts[0] = 0
    out = {}
    for part in ("valid", "test"):
        inputs, targets = ds.to_padded(max_len, part)
        scores = counts.expand(len(targets), -1)
        out[part] = dict(zip(("ndcg@10", "hit@10"), ndcg_hit_at_k(target_ranks(scores, targets, inputs))))
    return out


def quantiles(t: torch.Tensor) -> dict:
    t = t.flatten().double()
    qs = torch.tensor([0.0, 0.5, 0.9, 0.99, 1.0], dtype=torch.float64)
    return {f"q{int(q * 100)}": v for q, v in zip(qs.tolist(), torch.quantile(t, qs).tolist())}


@torch.no_grad()
def correction_sizes(model, ds, max_len: int, users: int = 512) -> dict:
    """Record every score correction Re-Attention subtracts on ``users`` test inputs, then compare
    the final rankings with Re-Attention on and off."""
    inputs, targets = ds.to_padded(max_len, "test")
    inputs, targets = inputs[:users], targets[:users]
    recorded = []
    original = ep.score_correction

    def spy(q, key_var, scale):
        c = original(q, key_var, scale)
        recorded.append(c.detach().flatten())
        return c

    ep.score_correction = spy
    try:
        model.eval()
        on = model.out(model.features(inputs)[:, -1])
    finally:
        ep.score_correction = original
    corrections = torch.cat(recorded)
    noise_std = model.reattention.noise_std.clone()
    model.reattention.noise_std.zero_()
    off = model.out(model.features(inputs)[:, -1])
    model.reattention.noise_std.copy_(noise_std)
    r_on, r_off = target_ranks(on, targets, inputs), target_ranks(off, targets, inputs)
    top_on, top_off = on.topk(10).indices.sort().values, off.topk(10).indices.sort().values
    scale = model.config.d_model**0.5
    item_err = scale * float(noise_std) / model.reattention.item_freq[1:]
    return {
        "noise_std_sigma_R_over_B": float(noise_std),
        "item_embedding_error_std": quantiles(item_err),
        "score_correction": quantiles(corrections),
        "max_abs_logit_change": (on - off).abs().max().item(),
        "users_with_changed_top10": (top_on != top_off).any(1).float().mean().item(),
        "users_with_changed_target_rank": (r_on != r_off).float().mean().item(),
        "ndcg@10_on_off": [ndcg_hit_at_k(r_on)[0], ndcg_hit_at_k(r_off)[0]],
        "users": len(targets),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="synthetic")
    p.add_argument(
        "--data-dir",
        default=None,
        help="folder holding the datasets (e.g. ml-1m/ml-1m.txt), exported as $DPZOO_DATA; "
        "default $DPZOO_DATA, else dpzoo's cache",
    )
    p.add_argument("--epsilon", type=float, default=5.0)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--max-len", type=int, default=50, help="sequence length of the diagnostic model")
    p.add_argument("--eval-max-len", type=int, default=200, help="sequence length of the popularity baseline")
    p.add_argument("--max-physical-batch-size", type=int, default=256)
    p.add_argument(
        "--model",
        default=None,
        help="a dpformer saved by `dpzoo train dpformer --out DIR` (DIR/model): measure it instead of training one",
    )
    p.add_argument("--out", default=None, help="write the measurements here as JSON")
    args = p.parse_args(argv)
    if args.data_dir is not None:
        os.environ["DPZOO_DATA"] = str(Path(args.data_dir).resolve())

    ds = get_dataset(args.data)
    # history exclusion depends on the length kept, so the baseline is given at both lengths
    report = {
        "settings": vars(args),
        "dataset": ds.summary(),
        "popularity": {f"max_len_{n}": popularity(ds, n) for n in sorted({args.max_len, args.eval_max_len})},
    }
    print("popularity baseline:", json.dumps(report["popularity"]))
    if args.model:
        model = load(args.model)
        report["training"] = {"model_dir": str(args.model), "privacy": privacy_metadata(args.model)}
    else:
        t0 = time.time()
        with tempfile.TemporaryDirectory() as tmp:
            result = train_seqrec(
                "dpformer",
                data=args.data,
                epsilon=args.epsilon,
                epochs=args.epochs,
                batch_size=args.batch_size,
                lr=args.lr,
                max_len=args.max_len,
                eval_every=args.epochs,
                max_physical_batch_size=args.max_physical_batch_size,
                out=tmp,
                log=print,
            )
            model = load(Path(tmp) / "model")
        report["training"] = {k: v for k, v in result.items() if k != "dataset"}
        report["training"]["wall_seconds"] = time.time() - t0
    if getattr(model, "reattention", None) is None or float(model.reattention.noise_std) == 0.0:
        raise SystemExit("the model has no active Re-Attention (not a dpformer trained with DP noise)")
    args.max_len = model.config.max_len
    report["reattention"] = correction_sizes(model, ds, args.max_len)
    report["model_test_same_len"] = evaluate(model, ds, args.max_len, "test")
    print(json.dumps(report["reattention"], indent=2))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        tmp.replace(out)


if __name__ == "__main__":
    main()
