"""Private training of next-item models with user-level DP (DPFormer paper §6, App. E.3).

One sequence per user is one sample of Poisson sampling and per-sample clipping, so the
guarantee is user-level. Automatic clipping with C = 1, learning rate with 20% linear
warm-up then linear decay (App. E.3), evaluation of NDCG@10 / HIT@10 on the validation and
test items every ``eval_every`` epochs (:mod:`dpzoo.seqrec.metrics`), results as JSON and a
plot of the metrics over epochs, and the model saved with its privacy metadata.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import cast

import torch
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

from ..errors import DPZooError
from ..hub import load, save
from ..losses import SequenceCrossEntropy
from ..privacy import DPOptimizer, PrivacyEngine
from .dataset import SequenceDataset, sasrec_preprocess
from .downloads import DATASETS, load_dataset
from .metrics import ndcg_hit_at_k, target_ranks
from .synthetic import zipf_interactions

__all__ = ["train_seqrec", "evaluate", "get_dataset"]


def get_dataset(data: str, seed: int = 0, amazon_columns: str | None = None) -> SequenceDataset:
    if data == "synthetic":
        return sasrec_preprocess(zipf_interactions(seed=seed), name="synthetic")
    return load_dataset(data, amazon_columns=amazon_columns)


@torch.no_grad()
def evaluate(
    model, dataset: SequenceDataset, max_len: int, part: str = "test", k: int = 10, batch_size: int = 512
) -> dict[str, float]:
    """NDCG@k and HIT@k of the held-out item, ranked against all items (history excluded)."""
    inputs, targets = dataset.to_padded(max_len, part)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    ranks = []
    for i in range(0, len(targets), batch_size):
        x, t = inputs[i : i + batch_size].to(device), targets[i : i + batch_size].to(device)
        # left padding: the last position predicts the next item; only its logits are computed
        scores = model.out(model.features(x)[:, -1]) if hasattr(model, "features") else model(x)[:, -1]
        ranks.append(target_ranks(scores, t, x).cpu())
    model.train(was_training)
    ndcg, hit = ndcg_hit_at_k(torch.cat(ranks), k)
    return {f"ndcg@{k}": ndcg, f"hit@{k}": hit}


def _plot(history: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in ("test_ndcg@10", "test_hit@10"):
        ax.plot(epochs, [100 * h[key] for h in history], marker="o", label=key.replace("test_", ""))
    ax.set_xlabel("epoch")
    ax.set_ylabel("%")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def train_seqrec(
    name: str,
    *,
    data: str = "synthetic",
    epsilon: float = 5.0,
    delta: float | None = None,
    epochs: int = 100,
    batch_size: int = 256,
    lr: float = 1e-3,
    max_len: int | None = None,
    max_grad_norm: float = 1.0,
    clipping: str = "automatic",
    eval_every: int = 5,
    max_physical_batch_size: int | None = None,
    accountant: str = "rdp",
    seed: int = 0,
    weight_decay: float = 1e-5,
    device: str | torch.device = "cpu",
    private: bool = True,
    out: str | Path | None = None,
    overrides: dict | None = None,
    log=print,
    amazon_columns: str | None = None,
) -> dict:
    """Train ``name`` (a sequential-recommendation zoo entry) privately on ``data``.

    ``device`` is where the model and each batch live ("cpu", "cuda", ...); Poisson sampling
    and the accountant stay on the CPU. ``private=False`` trains the same model with the same
    batch size, schedule and evaluation but no clipping, noise or accounting (shuffled batches):
    the non-private reference (its ε is reported as ``None``; no privacy metadata is saved).
    ``amazon_columns`` gives the column order of an Amazon CSV passed as a path (see
    :func:`dpzoo.seqrec.downloads.load_dataset`)."""
    torch.manual_seed(seed)
    ds = get_dataset(data, seed, amazon_columns)
    n_users = len(ds.train_sequences())
    delta = delta if delta is not None else 1.0 / n_users**1.1  # delta < 1/N, the usual choice
    max_len = max_len or (DATASETS[data].max_len if data in DATASETS else 50)  # the spec's default
    model = load(name, num_items=ds.num_items, max_len=max_len, **(overrides or {})).train().to(device)
    x, y = ds.to_padded(max_len, "train")
    if len(x) == 0:
        raise DPZooError(f"{data}: no user has 2 or more training items.")
    if hasattr(model, "set_token_frequencies"):  # Re-Attention's p_i (Claim 5.4)
        model.set_token_frequencies(x)
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    train_set, batch = TensorDataset(x, y), min(batch_size, len(x))
    engine = None
    if private:  # the engine replaces the loader by Poisson sampling at rate batch / N
        engine = PrivacyEngine(accountant=accountant)
        model, opt, loader = engine.make_private(
            module=model,
            optimizer=opt,
            data_loader=DataLoader(train_set, batch_size=batch),
            target_epsilon=epsilon,
            target_delta=delta,
            epochs=epochs,
            max_grad_norm=max_grad_norm,
            clipping=clipping,
            mode="bk-mixopt",
            max_physical_batch_size=max_physical_batch_size,
        )
        # Poisson membership and noise are secret (OS entropy): `seed` sets the initialisation only
        base_opt = opt.original_optimizer
    else:
        loader = DataLoader(train_set, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(seed))
        base_opt = opt
    total = epochs * len(loader)
    warm = max(1, int(0.2 * total))
    sched = torch.optim.lr_scheduler.LambdaLR(  # App. E.3: 20% warm-up, then linear decay
        base_opt, lambda s: (s + 1) / warm if s < warm else max(0.0, (total - s) / (total - warm))
    )
    crit = SequenceCrossEntropy(ignore_index=0, token_reduction="mean")
    if private:
        log(
            f"{name} on {data}: {n_users} users (one sequence each = the privacy unit), {ds.num_items} items; "
            f"σ = {engine.noise_multiplier:.3f}, q = {engine.sample_rate:.4f}, {total} steps, target ε = {epsilon} at δ = {delta:.2e}"
        )
    else:
        log(
            f"{name} on {data}: NON-PRIVATE reference (no clipping, no noise), {n_users} users, "
            f"{ds.num_items} items, {total} steps"
        )
    history = []
    t0 = time.time()
    epoch_iter = tqdm(range(1, epochs + 1), desc=name, disable=None)
    if private:  # once per logical step, the engine's noise-only steps on empty batches included
        cast(DPOptimizer, opt).attach_step_hook(lambda _: sched.step())
    for epoch in epoch_iter:
        for xb, yb in loader:
            crit(model(xb.to(device)), yb.to(device)).backward()
            opt.step()  # with physical batches only the last one of a logical batch steps
            opt.zero_grad()
            if not private:
                sched.step()
        if epoch % eval_every == 0 or epoch == epochs:
            val, test = evaluate(model, ds, max_len, "valid"), evaluate(model, ds, max_len, "test")
            row = {
                "epoch": epoch,
                "epsilon": engine.get_epsilon(delta) if private else None,
                "seconds": time.time() - t0,
                **{f"valid_{k}": v for k, v in val.items()},
                **{f"test_{k}": v for k, v in test.items()},
            }
            history.append(row)
            eps_text = f"ε = {row['epsilon']:.2f}" if private else "non-private"
            log(
                f"epoch {epoch}: test NDCG@10 {100 * test['ndcg@10']:.2f}%  HIT@10 {100 * test['hit@10']:.2f}%  "
                f"{eps_text}  ({row['seconds']:.0f}s)"
            )
    result = {
        "model": name,
        "data": data,
        "private": private,
        "epsilon_target": epsilon if private else None,
        "delta": delta if private else None,
        "epochs": epochs,
        "batch_size": batch_size,
        "lr": lr,
        "max_len": max_len,
        "noise_multiplier": engine.noise_multiplier if private else 0.0,
        "sample_rate": engine.sample_rate if private else None,
        "accountant": accountant if private else None,
        "seed": seed,
        "device": str(device),
        "history": history,
        "dataset": ds.summary(),
    }
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        privacy = None
        if private:
            engine.detach()
            privacy = {**engine.privacy_metadata(delta), "privacy_unit": "user"}
        save(model, out / "model", privacy=privacy)
        (out / "metrics.json").write_text(json.dumps(result, indent=2) + "\n")
        _plot(history, out / "metrics.png", f"{name} on {data}, " + (f"ε = {epsilon}" if private else "non-private"))
        log(
            f"saved the model{' (with its privacy metadata)' if private else ''}, metrics.json and metrics.png to {out}"
        )
    return result
