"""Private training of next-item models with user-level DP (DPFormer paper §6, App. E.3).

One sequence per user is one sample of Poisson sampling and per-sample clipping, so the
guarantee is user-level. Automatic clipping with C = 1, learning rate with 20% linear
warm-up then linear decay (App. E.3), evaluation of NDCG@10 / HIT@10 on the validation and
test items every ``eval_every`` epochs (:mod:`dpzoo.seqrec.metrics`), beside the popularity
ranking as a reference. The run (:class:`SeqrecRun` over :class:`dpzoo.runs.run.TrainingRun`) shows a progress bar,
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
from ..hub.load_save import load
from ..losses import SequenceCrossEntropy
from ..privacy import PrivacyEngine
from ..privacy.accounting.accountant import Accountant
from ..runs.loop import check_loop_arguments
from ..runs.run import TrainingRun
from .dataset import SequenceDataset, sasrec_preprocess
from .downloads import DATASETS, load_dataset
from .item_prior import ITEM_PRIORS, item_weights, log_prior, private_item_weights, set_output_prior
from .memory import PhysicalBatch, check_physical_batch_size, choose_physical_batch
from .metrics import ndcg_hit_at_k, target_ranks
from .synthetic import zipf_interactions

__all__ = ["train_seqrec", "evaluate", "get_dataset", "popularity_baseline", "SeqrecRun"]

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
    return SeqrecRun(dict(locals())).run()


class SeqrecRun(TrainingRun):
    """:func:`train_seqrec`'s run: a next-item model, one sequence per user, private or not."""

    def make_settings(self) -> dict:
        names = ("name", "data", "epsilon", "delta", "epochs", "batch_size", "lr", "max_len", "max_grad_norm",
                 "clipping", "eval_every", "max_physical_batch_size", "accountant", "seed", "weight_decay", "private")  # fmt: skip
        settings: dict[str, Any] = {"kind": "seqrec", **{n: getattr(self.o, n) for n in names}}
        settings["overrides"] = dict(self.o.overrides or {})
        later = ("amazon_columns", "mode", "noise_seed", "sample_seed", "item_prior", "item_prior_noise")
        return {**settings, **{n: getattr(self.o, n) for n in later}}

    def check(self) -> None:
        o = self.o
        if o.item_prior not in ITEM_PRIORS:
            raise InvalidArgumentError(f"item_prior must be one of {', '.join(ITEM_PRIORS)}, got {o.item_prior!r}.")
        check_loop_arguments(epochs=o.epochs, eval_every=o.eval_every, checkpoint_every=o.checkpoint_every)
        check_physical_batch_size(o.max_physical_batch_size)
        max_len = o.max_len
        if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1):
            raise InvalidArgumentError(
                f"max_len must be a whole number >= 1 (items per input sequence), got {max_len!r}."
            )
        fixed = sorted(set(self.settings["overrides"]) & set(_DATA_OVERRIDES))
        if fixed:
            raise InvalidArgumentError(f"override {fixed[0]!r} is set by {_DATA_OVERRIDES[fixed[0]]}: drop it.")

    def build(self, device, checkpoint):
        o = self.o
        self.ds = ds = get_dataset(o.data, o.seed, o.amazon_columns)
        self.n_users = len(ds.train_sequences())
        self.delta = o.delta if o.delta is not None else 1.0 / self.n_users**1.1  # delta < 1/N, the usual choice
        self.max_len = o.max_len or (DATASETS[o.data].max_len if o.data in DATASETS else 50)  # the spec's default
        self.model_overrides = {**RECIPE_OVERRIDES, **self.settings["overrides"]}
        model = load(o.name, num_items=ds.num_items, max_len=self.max_len, **self.model_overrides).train().to(device)
        x, y = ds.to_padded(self.max_len, "train")
        if len(x) < 2:
            raise DPZooError(
                f"{o.data}: {len(x)} user(s) with 2 or more training items; training (and user-level DP) needs many "
                "users."
            )
        self.batch_size = o.batch_size
        if self.batch_size is None:  # the recipe's 1024 (q ≈ 0.17 on MovieLens-1M), a quarter of the users if fewer
            self.batch_size = self.settings["batch_size"] = max(1, min(1024, len(x) // 4))
        if self.batch_size > len(x):
            raise InvalidArgumentError(
                f"batch_size {self.batch_size} is larger than the {len(x)} users of {o.data} (the sample rate would "
                f"exceed 1): use at most {len(x)}."
            )
        if hasattr(model, "set_token_frequencies"):  # Re-Attention's p_i (Claim 5.4)
            model.set_token_frequencies(x)
        self.released = o.item_prior == "private" and o.private
        if o.item_prior != "none" and checkpoint is None:  # on resume the checkpoint holds the bias
            if self.released:
                gen = torch.Generator().manual_seed(o.noise_seed + 1) if o.noise_seed is not None else None
                weights = private_item_weights(x, ds.num_items, o.item_prior_noise, generator=gen)
            else:
                weights = item_weights(x, ds.num_items)
            set_output_prior(model, log_prior(weights))
        self.physical = PhysicalBatch(size=None, batch_size=self.batch_size)  # without DP: plain batches
        self.rows = len(x)
        return model, TensorDataset(x, y)

    def new_engine(self, checkpoint):
        if not self.o.private:
            return None
        # the item prior's release is the first entry of the history σ is calibrated after
        # (on resume the checkpoint's history holds that release: restored, not recorded again)
        first = [[self.o.item_prior_noise, 1.0, 1]] if self.released and checkpoint is None else []
        return PrivacyEngine(Accountant(self.o.accountant, first))

    def optimizer(self, model):
        return torch.optim.Adam(model.parameters(), lr=self.o.lr, weight_decay=self.o.weight_decay)

    def engine_options(self, model, device) -> dict:
        o = self.o
        self.physical = choose_physical_batch(
            o.max_physical_batch_size,
            model,
            max_len=self.max_len,
            batch_size=self.batch_size,
            device=device,
            mode=o.mode,
        )
        return {
            "max_physical_batch_size": self.physical.size,
            "privacy_unit": "user",  # one sequence per user: Poisson over users, each user's row clipped
            "user_ids": range(self.rows),
            "max_examples_per_user": 1,
        }

    def non_private_loader(self, train_set):
        gen = torch.Generator().manual_seed(self.o.seed)
        return DataLoader(train_set, batch_size=self.batch_size, shuffle=True, generator=gen)

    def scheduler(self, optimizer, engine, total_steps):
        base = optimizer.original_optimizer if engine is not None else optimizer
        warm = max(1, int(0.2 * total_steps))
        return torch.optim.lr_scheduler.LambdaLR(  # App. E.3: 20% warm-up, then linear decay
            base, lambda s: (s + 1) / warm if s < warm else max(0.0, (total_steps - s) / max(1, total_steps - warm))
        )

    def first_line(self, engine, loop, resumed) -> str:
        o, ds = self.o, self.ds
        after = f" (resumed after step {loop.step})" if resumed else ""
        if engine is None:
            return (
                f"{o.name} on {o.data}: NON-PRIVATE reference (no clipping, no noise), {self.n_users} users, "
                f"{ds.num_items} items, {loop.total_steps} steps{after}"
            )
        return (
            f"{o.name} on {o.data}: {self.n_users} users (one sequence each = the privacy unit), {ds.num_items} items; "
            f"σ = {engine.noise_multiplier:.3f}, q = {engine.sample_rate:.4f}, {loop.total_steps} steps, "
            f"target ε = {o.epsilon} at δ = {self.delta:.2e} (item prior: {_prior_words(o.item_prior, o.item_prior_noise)}); "
            f"{self.physical.describe()}{after}"
        )

    def loss(self, model, batch, device):
        xb, yb = batch
        return SequenceCrossEntropy(ignore_index=0, token_reduction="mean")(model(xb.to(device)), yb.to(device))

    def evaluate(self, model, device) -> dict:
        val, test = evaluate(model, self.ds, self.max_len, "valid"), evaluate(model, self.ds, self.max_len, "test")
        return {**{f"valid_{k}": v for k, v in val.items()}, **{f"test_{k}": v for k, v in test.items()}}

    def describe(self, r: dict) -> str:
        eps_text = f"ε = {r['epsilon']:.2f}" if self.o.private else "non-private"
        return (
            f"epoch {r['epoch']}: test NDCG@10 {100 * r['test_ndcg@10']:.2f}%  HIT@10 {100 * r['test_hit@10']:.2f}%  "
            f"{eps_text}  ({r['seconds']:.0f}s)"
        )

    def result(self, engine, loop, history, device) -> dict:
        o, private = self.o, self.o.private
        self.popularity = popularity_baseline(self.ds, self.max_len)
        return {
            "model": o.name,
            "data": o.data,
            "private": private,
            "epsilon_target": o.epsilon if private else None,
            "epsilon": loop.epsilon(),
            "delta": self.delta if private else None,
            "epochs": o.epochs,
            "steps": loop.step,
            "batch_size": self.batch_size,
            "lr": o.lr,
            "max_len": self.max_len,
            "mode": o.mode if private else None,
            "physical_batch": self.physical.as_dict() if private else None,
            "noise_multiplier": engine.noise_multiplier if engine is not None else 0.0,
            "sample_rate": engine.sample_rate if engine is not None else None,
            "accountant": o.accountant if private else None,
            "item_prior": o.item_prior,
            "item_prior_noise": o.item_prior_noise if self.released else None,
            "model_overrides": self.model_overrides,
            "seed": o.seed,
            "device": str(device),
            "history": history,
            "popularity": self.popularity,
            "dataset": self.ds.summary(),
        }

    def privacy_metadata(self, engine, model) -> dict:
        privacy = engine.privacy_metadata(self.delta)
        public = _public_statistics(model, self.o.item_prior)
        if public:
            privacy["public_statistics"] = "; ".join(public) + ": taken as public, outside ε"
        return privacy

    def plot(self):
        o = self.o
        title = f"{o.name} on {o.data}, " + (f"target ε = {o.epsilon}" if o.private else "non-private")
        series = [(f"{p}_{m}@10", f"{p} {m.upper()}@10") for m in ("ndcg", "hit") for p in ("test", "valid")]
        refs = {f"popularity, test {m.upper()}@10": self.popularity["test"][f"{m}@10"] for m in ("ndcg", "hit")}
        return title, series, {"percent": True, "references": refs}

    def datasets(self):
        named = self.o.data in DATASETS or self.o.data == "synthetic"
        return [self.o.data] if named else None  # a user's path stays off the card
