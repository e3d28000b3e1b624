"""Private training of next-item models with user-level DP (DPFormer paper §6, App. E.3).

One sequence per user is one sample of Poisson sampling and per-sample clipping, so the
guarantee is user-level. Automatic clipping with C = 1, learning rate with 20% linear
warm-up then linear decay (App. E.3), evaluation of NDCG@10 / HIT@10 on the validation and
test items every ``eval_every`` epochs (:mod:`dpzoo.seqrec.metrics`), beside the popularity
ranking as a reference. The run (:class:`dpzoo.runs.loop.TrainingLoop`) shows a progress bar,
appends each evaluation to metrics.csv (and TensorBoard), saves checkpoints it can resume from
with the same ε bookkeeping, and at the end writes metrics.json, a plot and the model with
its privacy metadata.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils.data import DataLoader, TensorDataset

from ..errors import DPZooError, InvalidArgumentError
from ..hub.load_save import load, save
from ..losses import SequenceCrossEntropy
from ..privacy import PrivacyEngine
from ..privacy.accounting.accountant import Accountant
from ..runs.files import open_run, write_json
from ..runs.loop import TrainingLoop, check_loop_arguments, resolve_device
from ..runs.plots import plot_metrics
from .dataset import SequenceDataset, sasrec_preprocess
from .downloads import DATASETS, load_dataset
from .item_prior import ITEM_PRIORS, item_weights, log_prior, private_item_weights, set_output_prior
from .memory import PhysicalBatch, check_physical_batch_size, choose_physical_batch
from .metrics import ndcg_hit_at_k, target_ranks
from .synthetic import zipf_interactions

__all__ = ["train_seqrec", "evaluate", "get_dataset", "popularity_baseline"]

# overrides the data fixes: --set cannot change them
_DATA_OVERRIDES = {"num_items": "the data's item count", "max_len": "max_len (--max-len)"}
# the recipe's model settings, under the user's overrides: no dropout (under DP at ε = 5 on
# MovieLens-1M dropout 0.2, SASRec's, slowed learning; the noise regularises: docs/RESULTS.md)
RECIPE_OVERRIDES = {"dropout": 0.0}


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


def popularity_baseline(
    dataset: SequenceDataset, max_len: int, k: int = 10, batch_size: int = 512
) -> dict[str, dict[str, float]]:
    """NDCG@k / HIT@k of ranking every item by the number of training sequences holding it (the
    frequencies Re-Attention treats as public), history excluded as in :func:`evaluate`; for
    the "valid" and "test" parts. The level a model must beat to have learned anything."""
    x, _ = dataset.to_padded(max_len, "train")
    counts = item_weights(x, dataset.num_items, normalize=False)  # each item once per sequence
    out = {}
    for part in ("valid", "test"):
        inputs, targets = dataset.to_padded(max_len, part)
        ranks = []
        for i in range(0, len(targets), batch_size):
            t = targets[i : i + batch_size]
            ranks.append(target_ranks(counts.expand(len(t), -1), t, inputs[i : i + batch_size]))
        ndcg, hit = ndcg_hit_at_k(torch.cat(ranks), k)
        out[part] = {f"ndcg@{k}": ndcg, f"hit@{k}": hit}
    return out


def _prior_words(item_prior: str, noise: float) -> str:
    return {
        "private": f"released with σ_f = {noise:g}, inside ε",
        "public": "exact (noiseless) frequencies, outside ε",
        "none": "none",
    }[item_prior]


def _public_statistics(model, item_prior: str) -> list[str]:
    """What a run uses from its training data outside ε (the DPFormer paper's Remark C.1)."""
    used = []
    if item_prior == "public":
        used.append("the items' exact frequencies in the output bias (item_prior='public')")
    if getattr(model, "reattention", None) is not None:
        used.append("item and position frequencies in Re-Attention")
    return used


def train_seqrec(
    name: str,
    *,
    data: str = "synthetic",
    epsilon: float = 5.0,
    delta: float | None = None,
    epochs: int = 20,
    batch_size: int | None = None,
    lr: float = 1e-2,
    max_len: int | None = None,
    max_grad_norm: float = 1.0,
    clipping: str = "automatic",
    eval_every: int = 5,
    max_physical_batch_size: int | str | None = "auto",
    accountant: str = "rdp",
    seed: int = 0,
    weight_decay: float = 1e-5,
    device: str | torch.device = "cpu",
    private: bool = True,
    out: str | Path | None = None,
    overrides: dict | None = None,
    log: Callable[[str], None] = print,
    amazon_columns: str | None = None,
    mode: str = "bk-mixopt",
    noise_seed: int | None = None,
    sample_seed: int | None = None,
    checkpoint_every: int | str = "epoch",
    resume: str | Path | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
    step_callback: Callable[[int], None] | None = None,
    handle_sigint: bool = False,
    item_prior: str = "private",
    item_prior_noise: float = 5.0,
) -> dict:
    """Train ``name`` (a sequential-recommendation zoo entry) privately on ``data``.

    ``device`` is where the model and each batch live ("cpu", "cuda", ...); Poisson sampling
    and the accountant stay on the CPU. ``private=False`` trains the same model with the same
    batch size, schedule and evaluation but no clipping, noise or accounting (shuffled batches):
    the non-private reference (its ε is reported as ``None``; no privacy metadata is saved).
    ``amazon_columns`` gives the column order of an Amazon CSV passed as a path (see
    :func:`dpzoo.seqrec.downloads.load_dataset`). ``mode``: the engine's training mode
    ("bitfit": DP-BiTFiT, biases only). ``seed`` fixes the initialisation, the synthetic data
    and the non-private shuffling; Poisson membership and noise are secret unless
    ``sample_seed`` / ``noise_seed`` are given (tests only: recorded in the metadata).
    ``out``, ``overwrite``, ``checkpoint_every``, ``resume``, ``progress`` and
    ``step_callback``: as in :func:`dpzoo.runs.classifier.train_image_classifier`. ``max_physical_batch_size``
    bounds the users of one forward and backward pass (each Poisson batch is split into micro-batches;
    memory and time only, the DP step is the same): a number, None (whole batches), or "auto" (the
    default): the largest micro-batch whose estimated peak memory fits in half of the memory available
    on ``device`` (:mod:`dpzoo.seqrec.memory`), logged in the first line and recorded in metrics.json
    (``physical_batch``); without DP it does not apply. ``item_prior`` sets the
    output bias to the items' log-frequencies before training (:mod:`dpzoo.seqrec.item_prior`):
    "private" releases them with the Gaussian mechanism at noise multiplier ``item_prior_noise``,
    composed into ε; "public" uses the exact counts outside ε (the DPFormer paper's assumption,
    recorded in the metadata); "none" starts the bias at zero. The defaults are the ε = 5
    MovieLens-1M recipe of docs/RESULTS.md: 20 epochs, ``batch_size`` 1024 (a quarter of the users
    on smaller data), Adam at ``lr`` 1e-2 with 20% warm-up and linear decay, the private prior,
    and the model without dropout (``RECIPE_OVERRIDES``; ``overrides={"dropout": 0.2}`` restores
    the zoo card's SASRec setting)."""
    settings: dict[str, Any] = {
        "kind": "seqrec",
        "name": name,
        "data": data,
        "epsilon": epsilon,
        "delta": delta,
        "epochs": epochs,
        "batch_size": batch_size,
        "lr": lr,
        "max_len": max_len,
        "max_grad_norm": max_grad_norm,
        "clipping": clipping,
        "eval_every": eval_every,
        "max_physical_batch_size": max_physical_batch_size,
        "accountant": accountant,
        "seed": seed,
        "weight_decay": weight_decay,
        "private": private,
        "overrides": dict(overrides or {}),
        "amazon_columns": amazon_columns,
        "mode": mode,
        "noise_seed": noise_seed,
        "sample_seed": sample_seed,
        "item_prior": item_prior,
        "item_prior_noise": item_prior_noise,
    }
    if item_prior not in ITEM_PRIORS:
        raise InvalidArgumentError(f"item_prior must be one of {', '.join(ITEM_PRIORS)}, got {item_prior!r}.")
    check_loop_arguments(epochs=epochs, eval_every=eval_every, checkpoint_every=checkpoint_every)
    check_physical_batch_size(max_physical_batch_size)
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1):
        raise InvalidArgumentError(f"max_len must be a whole number >= 1 (items per input sequence), got {max_len!r}.")
    fixed = sorted(set(settings["overrides"]) & set(_DATA_OVERRIDES))
    if fixed:
        raise InvalidArgumentError(f"override {fixed[0]!r} is set by {_DATA_OVERRIDES[fixed[0]]}: drop it.")
    dev = resolve_device(device)
    run_dir, checkpoint = open_run(out, settings, resume=resume, overwrite=overwrite)
    torch.manual_seed(seed)
    ds = get_dataset(data, seed, amazon_columns)
    n_users = len(ds.train_sequences())
    delta = delta if delta is not None else 1.0 / n_users**1.1  # delta < 1/N, the usual choice
    max_len = max_len or (DATASETS[data].max_len if data in DATASETS else 50)  # the spec's default
    model_overrides = {**RECIPE_OVERRIDES, **settings["overrides"]}
    model = load(name, num_items=ds.num_items, max_len=max_len, **model_overrides).train().to(dev)
    x, y = ds.to_padded(max_len, "train")
    if len(x) < 2:
        raise DPZooError(
            f"{data}: {len(x)} user(s) with 2 or more training items; training (and user-level DP) needs many users."
        )
    if batch_size is None:  # the recipe's 1024 (q ≈ 0.17 on MovieLens-1M), a quarter of the users if fewer
        batch_size = max(1, min(1024, len(x) // 4))
        settings["batch_size"] = batch_size
    if batch_size > len(x):
        raise InvalidArgumentError(
            f"batch_size {batch_size} is larger than the {len(x)} users of {data} (the sample rate would exceed 1): "
            f"use at most {len(x)}."
        )
    if hasattr(model, "set_token_frequencies"):  # Re-Attention's p_i (Claim 5.4)
        model.set_token_frequencies(x)
    released = item_prior == "private" and private
    if item_prior != "none" and checkpoint is None:  # on resume the checkpoint holds the bias
        if released:
            gen = torch.Generator().manual_seed(noise_seed + 1) if noise_seed is not None else None
            weights = private_item_weights(x, ds.num_items, item_prior_noise, generator=gen)
        else:
            weights = item_weights(x, ds.num_items)
        set_output_prior(model, log_prior(weights))
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    train_set = TensorDataset(x, y)
    engine = None
    physical = PhysicalBatch(size=None, batch_size=batch_size)  # without DP: plain batches
    if private:  # the engine replaces the loader by Poisson sampling at rate batch / N
        # the item prior's release is the first entry of the history σ is calibrated after
        # (on resume the checkpoint's history holds that release: restored, not recorded again)
        engine = PrivacyEngine(
            Accountant(accountant, [[item_prior_noise, 1.0, 1]] if released and checkpoint is None else [])
        )
        physical = choose_physical_batch(
            max_physical_batch_size, model, max_len=max_len, batch_size=batch_size, device=dev, mode=mode
        )
        noise = (
            {"target_epsilon": epsilon}
            if checkpoint is None
            else {"noise_multiplier": checkpoint["engine"]["noise_multiplier"]}  # σ of the whole run, kept
        )
        model, opt, loader = engine.make_private(
            module=model,
            optimizer=opt,
            data_loader=DataLoader(train_set, batch_size=batch_size),
            target_delta=delta,
            epochs=epochs,
            max_grad_norm=max_grad_norm,
            clipping=clipping,
            mode=mode,
            max_physical_batch_size=physical.size,
            noise_seed=noise_seed,
            sample_seed=sample_seed,
            privacy_unit="user",  # one sequence per user: Poisson over users, each user's row clipped
            user_ids=range(len(train_set)),
            max_examples_per_user=1,
            **noise,
        )
        base_opt = opt.original_optimizer
    else:
        loader = DataLoader(
            train_set, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed)
        )
        base_opt = opt
    total = epochs * len(loader)
    warm = max(1, int(0.2 * total))
    sched = torch.optim.lr_scheduler.LambdaLR(  # App. E.3: 20% warm-up, then linear decay
        base_opt, lambda s: (s + 1) / warm if s < warm else max(0.0, (total - s) / max(1, total - warm))
    )
    loop = TrainingLoop(
        name=name,
        model=model,
        optimizer=opt,
        loader=loader,
        epochs=epochs,
        settings=settings,
        engine=engine,
        delta=delta,
        scheduler=sched,
        out=run_dir,
        checkpoint_every=checkpoint_every,
        progress=progress,
        step_callback=step_callback,
        log=log,
        handle_sigint=handle_sigint,
    )
    if checkpoint is not None:
        loop.load_state_dict(checkpoint)
    resumed = f" (resumed after step {loop.step})" if checkpoint is not None else ""
    if engine is not None:
        log(
            f"{name} on {data}: {n_users} users (one sequence each = the privacy unit), {ds.num_items} items; "
            f"σ = {engine.noise_multiplier:.3f}, q = {engine.sample_rate:.4f}, {total} steps, "
            f"target ε = {epsilon} at δ = {delta:.2e} (item prior: {_prior_words(item_prior, item_prior_noise)}); "
            f"{physical.describe()}{resumed}"
        )
    else:
        log(
            f"{name} on {data}: NON-PRIVATE reference (no clipping, no noise), {n_users} users, "
            f"{ds.num_items} items, {total} steps{resumed}"
        )
    crit = SequenceCrossEntropy(ignore_index=0, token_reduction="mean")

    def train_step(batch):
        xb, yb = batch
        loss = crit(model(xb.to(dev)), yb.to(dev))
        loss.backward()
        return loss

    def evaluate_both() -> dict:
        val, test = evaluate(model, ds, max_len, "valid"), evaluate(model, ds, max_len, "test")
        return {**{f"valid_{k}": v for k, v in val.items()}, **{f"test_{k}": v for k, v in test.items()}}

    def describe(r: dict) -> str:
        eps_text = f"ε = {r['epsilon']:.2f}" if engine is not None else "non-private"
        return (
            f"epoch {r['epoch']}: test NDCG@10 {100 * r['test_ndcg@10']:.2f}%  HIT@10 {100 * r['test_hit@10']:.2f}%  "
            f"{eps_text}  ({r['seconds']:.0f}s)"
        )

    history = loop.run(train_step, evaluate_both, eval_every=eval_every, describe=describe)
    popularity = popularity_baseline(ds, max_len)
    result = {
        "model": name,
        "data": data,
        "private": private,
        "epsilon_target": epsilon if private else None,
        "epsilon": loop.epsilon(),
        "delta": delta if private else None,
        "epochs": epochs,
        "steps": loop.step,
        "batch_size": batch_size,
        "lr": lr,
        "max_len": max_len,
        "mode": mode if private else None,
        "physical_batch": physical.as_dict() if private else None,
        "noise_multiplier": engine.noise_multiplier if engine is not None else 0.0,
        "sample_rate": engine.sample_rate if engine is not None else None,
        "accountant": accountant if private else None,
        "item_prior": item_prior,
        "item_prior_noise": item_prior_noise if released else None,
        "model_overrides": model_overrides,
        "seed": seed,
        "device": str(dev),
        "history": history,
        "popularity": popularity,
        "dataset": ds.summary(),
    }
    if run_dir is not None:
        privacy = None
        if engine is not None:
            engine.detach()
            privacy = engine.privacy_metadata(delta)
            public = _public_statistics(model, item_prior)
            if public:
                privacy["public_statistics"] = "; ".join(public) + ": taken as public, outside ε"
        write_json(run_dir / "metrics.json", result)  # before the model: a failed save keeps the metrics
        written = ["metrics.csv", "metrics.json"]
        title = f"{name} on {data}, " + (f"target ε = {epsilon}" if private else "non-private")
        series = [(f"{p}_{m}@10", f"{p} {m.upper()}@10") for m in ("ndcg", "hit") for p in ("test", "valid")]
        refs = {f"popularity, test {m.upper()}@10": popularity["test"][f"{m}@10"] for m in ("ndcg", "hit")}
        if plot_metrics(history, run_dir / "metrics.png", title, series, percent=True, references=refs):
            written.append("metrics.png")
        if (run_dir / "tensorboard").is_dir():
            written.append("tensorboard/")
        named = [data] if data in DATASETS or data == "synthetic" else None  # a user's path stays off the card
        save(model, run_dir / "model", privacy=privacy, datasets=named)
        log(f"saved the model{' (with its privacy metadata)' if privacy else ''}, {', '.join(written)} to {run_dir}")
    return result
