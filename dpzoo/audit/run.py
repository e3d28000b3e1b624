"""The audit procedure: :func:`audit` inserts canaries, trains once, scores, guesses and bounds ε.

The one-run audit of Steinke, Nasr & Jagielski (2023), Algorithm 1: each of m canaries is put in
the training set independently with probability 1/2 (S ∈ {-1, +1}^m), one private training run
(:mod:`dpzoo.audit.training`), a score per canary (:mod:`dpzoo.audit.task`), guesses and the
bound (:mod:`dpzoo.audit.from_scores`: guesses, the one-run and Gaussian-DP bounds), reported as an
:class:`~dpzoo.audit.AuditResult`. The white-box audit adds the Gaussian-DP estimator
(:mod:`dpzoo.audit.gdp`, Nasr et al. 2023); each is tested at half the error budget and the larger
bound is reported.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset, TensorDataset

from ..errors import DPZooError
from .from_scores import audit_from_scores
from .guesses import DEFAULT_GUESS_FRACTIONS
from .report import AuditResult
from .task import digits_canary_task, loss_score
from .training import BROKEN, train_audited_model
from .white_box import column_observer

__all__ = ["audit", "audit_from_scores", "with_canaries", "WHITE_BOX_CANARIES"]

# the white-box default: at 2,500 canaries (about 7 s) a 2R clip exceeds a claim of ε = 2 in every measured run
# (docs/RESULTS.md); at 1,000 it did in 3 of 5
WHITE_BOX_CANARIES = 2500
# audit()'s arguments passed on to the training run as they are
PASSED_ON = ("epsilon", "delta", "epochs", "lr", "max_grad_norm", "clipping", "broken", "accountant", "noise_seed",
             "sample_seed", "progress", "physical_batch_size", "loss_scale", "mode", "noise_multiplier")  # fmt: skip


def audit(
    *,
    epsilon: float = 2.0,
    delta: float = 1e-5,
    canaries: "int | tuple[torch.Tensor, torch.Tensor] | None" = None,
    epochs: int = 10,
    batch_size: "int | str" = 64,
    lr: float = 2.0,
    max_grad_norm: float = 1.0,
    clipping: str = "abadi",
    broken: str | None = None,
    confidence: float = 0.95,
    seed: int = 0,
    accountant: str = "rdp",
    canary_norm: float = 1000.0,
    dataset: Dataset | None = None,
    model_fn: Callable[[], nn.Module] | None = None,
    score_fn: Callable | None = None,
    loss_fn: Callable | None = None,
    test_dataset: Dataset | None = None,
    guess_fractions: Sequence[float] = DEFAULT_GUESS_FRACTIONS,
    noise_seed: int | None = None,
    sample_seed: int | None = None,
    log: Callable[[str], None] | None = None,
    progress: bool | None = None,
    threat_model: str = "black-box",
    physical_batch_size: int | None = None,
    loss_scale: float | None = None,
    mode: str = "auto",
    noise_multiplier: float | None = None,
    sample_rate: float | None = None,
    steps: int | None = None,
) -> AuditResult:
    """Insert canaries, train once with dpzoo's engine, return the empirical lower bound on ε.

    Built-in default (``dataset=None``): digits with ``canaries`` (an int, m; None: 1,000, or
    :data:`WHITE_BOX_CANARIES` for the white-box audit, where 2R-sensitivity bugs need them) Dirac
    canaries of norm ``canary_norm``, a linear classifier, :func:`logit_change_score`.

    General path: ``dataset`` (items ``(x, y)``), ``model_fn()`` (a fresh model whose trainable
    parameters dpzoo's engine covers), ``canaries=(canary_x, canary_y)`` (m canaries, each put
    in the training set with probability 1/2), ``score_fn(model, canary_x, canary_y)`` (higher:
    more likely in; default :func:`loss_score`), ``loss_fn(output, y)`` (a batch mean; default
    cross-entropy; a custom loss needs a ``score_fn``), optional ``test_dataset`` for accuracy.

    Training is the engine's public API: Poisson batches of expected size ``batch_size``
    (``"full"``: the whole training set, q = 1, where a white-box audit comes closest to its claim), SGD
    at ``lr``, ``target_epsilon=epsilon`` at ``delta`` over ``epochs``, Abadi clipping at
    ``max_grad_norm``. ``broken="no-noise"`` / ``"unclipped"``: the positive controls
    (:mod:`dpzoo.audit.training`). ``seed`` fixes the canaries, their inclusion, the model's
    initialisation and the tie-breaking (through torch's generator, isolated by
    ``torch.random.fork_rng``); the engine's noise and Poisson sampling are its own (secret)
    unless ``noise_seed`` / ``sample_seed`` are passed on to ``make_private`` (tests only).
    ``progress``: a per-step bar with the loss and the ε spent (None: when stderr is a terminal).
    The training path: ``physical_batch_size`` micro-batches through ``BatchMemoryManager``;
    ``loss_scale`` trains in float16 autocast with a ``DPGradScaler`` at that scale; ``mode`` is
    the engine's training mode (the built-in task then uses that mode's canary model:
    ``"bitfit"`` moves canary biases, ``"lora"`` a PEFT LoRA adapter,
    :mod:`dpzoo.audit.canary_models`). A given mechanism instead of a claim
    (:func:`dpzoo.audit.audit_record` audits a saved model's): ``noise_multiplier`` σ (then
    ``epsilon`` is not used), ``sample_rate`` q (the expected batch is q times the training set,
    canaries included), ``steps`` (training stops there). Run inside an initialised ``torch.distributed`` process
    group (every rank calling :func:`audit` alike), training is dpzoo's distributed DP: each rank
    a shard of every Poisson batch, the noise added once.
    Returns an :class:`AuditResult`; ``result.exceeds`` is True when the bound is above the
    claimed ε.

    Which guess counts to use is chosen after scoring, among ``guess_fractions`` of m (total
    guesses r, split evenly in / out), each tested at (1 - confidence) / len(guess_fractions).
    """
    given = dict(locals())  # the arguments, before any is rebound below
    claim = epsilon if noise_multiplier is None else 1.0  # a given σ: ε is not used
    _validate(claim, delta, epochs, batch_size, lr, max_grad_norm, broken, confidence, guess_fractions, mode)
    _validate_mechanism(noise_multiplier, sample_rate, steps)
    white = _threat_model(threat_model, dataset)
    if canaries is None and dataset is None:
        canaries = WHITE_BOX_CANARIES if white else 1000
    observed: list = []
    log = log or (lambda s: None)
    t0 = time.time()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        train, cx, cy, model_fn, score_fn, test_dataset = _task(
            canaries, canary_norm, seed, mode, dataset, model_fn, score_fn, loss_fn, test_dataset
        )
        loss_fn = loss_fn or F.cross_entropy
        included = torch.rand(len(cx), generator=torch.Generator().manual_seed(seed + 1)) < 0.5  # each in w.p. 1/2
        train_set = with_canaries(train, cx, cy, included, seed)
        if sample_rate is not None or batch_size == "full":  # q of the set with its canaries; q = 1
            batch_size = max(1, round((1.0 if sample_rate is None else sample_rate) * len(train_set)))
        model, claimed, mech = train_audited_model(
            train_set,
            model_fn,
            loss_fn,
            **{k: given[k] for k in PASSED_ON},
            batch_size=batch_size,
            log=log,
            on_private=column_observer(cy, observed) if white else None,
            max_steps=steps,
        )
        scores = _canary_scores(model, cx, cy, score_fn, mech, observed if white else None)
        accuracy = _accuracy(model, test_dataset) if test_dataset is not None else None
    return audit_from_scores(
        scores,
        included,
        claimed_epsilon=claimed,
        delta=delta,
        confidence=confidence,
        white_box=white,
        mechanism=mech,
        broken=broken,
        guess_fractions=guess_fractions,
        seed=seed,
        test_accuracy=accuracy,
        seconds=time.time() - t0,
    )


def _task(canaries, canary_norm, seed, mode, dataset, model_fn, score_fn, loss_fn, test_dataset):
    """(training set, canary inputs, labels, model_fn, score_fn, test set): the built-in digits
    canary task, or the user's dataset and canaries, checked."""
    if dataset is None:
        if not isinstance(canaries, int) or isinstance(canaries, bool) or canaries < 2:
            raise DPZooError(f"canaries must be an integer >= 2 for the built-in audit, got {canaries!r}.")
        if not canary_norm > 0:
            raise DPZooError(f"canary_norm must be > 0, got {canary_norm}.")
        train, test, cx, cy, default_model_fn, default_score = digits_canary_task(
            canaries, canary_norm, seed, mode=mode
        )
        model_fn = model_fn or default_model_fn
        score_fn = score_fn or default_score
        test_dataset = test if test_dataset is None else test_dataset
        return train, cx, cy, model_fn, score_fn, test_dataset
    else:
        if model_fn is None:
            raise DPZooError("audit(dataset=...) needs model_fn=: a function returning a fresh model.")
        if not (isinstance(canaries, (tuple, list)) and len(canaries) == 2):
            raise DPZooError(
                "audit(dataset=...) needs canaries=(canary_x, canary_y): the m canary inputs "
                "and labels (an integer count is only for the built-in digits audit)."
            )
        cx, cy = canaries
        if len(cx) != len(cy) or len(cx) < 2:
            raise DPZooError(
                f"canaries: need as many labels as inputs and at least 2 canaries, got "
                f"{len(cx)} inputs and {len(cy)} labels."
            )
        if loss_fn is not None and score_fn is None:
            raise DPZooError(
                "a custom loss_fn needs a score_fn (the default score is minus the cross-entropy loss of each canary)."
            )
        score_fn = score_fn or loss_score
        train = dataset
    return train, cx, cy, model_fn, score_fn, test_dataset


def _canary_scores(model, cx, cy, score_fn, mech: dict, observed: list | None) -> torch.Tensor:
    """One finite score per canary: from every noisy step seen (white-box), else from the final model."""
    model.eval()
    if observed is not None:  # white-box: every noisy update of the canaries' columns, not the final model
        observed[0].detach()
        mech["threat_model"], score_fn = "white-box: every noisy step", lambda *a: observed[0].scores
    else:
        mech["threat_model"] = "black-box: the final model"
    scores, m = score_fn(model, cx, cy).detach().float().flatten(), len(cx)
    if scores.shape[0] != m or not torch.isfinite(scores).all():
        raise DPZooError(
            f"score_fn must return {m} finite scores (one per canary), got shape "
            f"{tuple(scores.shape)}{'' if torch.isfinite(scores).all() else ' with non-finite values'}."
        )
    return scores


def with_canaries(train: Dataset, canary_x, canary_y, included: torch.Tensor, seed: int = 0) -> Dataset:
    """``train`` plus the included canaries, in a random order (``seed``): a canary sits anywhere in
    a Poisson batch and in its micro-batches, not always at the end, so a bug that depends on a
    sample's position in the batch reaches canaries and digits alike."""
    rows: ConcatDataset[tuple] = ConcatDataset([train, TensorDataset(canary_x[included], canary_y[included])])
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed + 3))
    return Subset(rows, order.tolist())


def _accuracy(model, dataset) -> float:
    correct = 0
    with torch.no_grad():
        for x, y in DataLoader(dataset, batch_size=512):
            correct += int((model(x).argmax(1) == y).sum())
    return correct / len(dataset)


def _validate(epsilon, delta, epochs, batch_size, lr, max_grad_norm, broken, confidence, guess_fractions, mode):
    from ..privacy.modes import TRAINING_MODES

    if mode not in TRAINING_MODES:
        raise DPZooError(f"mode must be one of {', '.join(TRAINING_MODES)} (the engine's training mode), got {mode!r}.")
    if not (isinstance(epsilon, (int, float)) and 0 < epsilon < math.inf):
        raise DPZooError(f"epsilon must be a finite number > 0 (the claimed ε), got {epsilon!r}.")
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise DPZooError(f"delta must be in (0, 1), e.g. 1e-5, got {delta!r}.")
    if not (isinstance(epochs, int) and epochs >= 1):
        raise DPZooError(f"epochs must be an integer >= 1, got {epochs!r}.")
    if not (batch_size == "full" or (isinstance(batch_size, int) and batch_size >= 1)):
        raise DPZooError(f"batch_size must be an integer >= 1 or 'full', got {batch_size!r}.")
    if not lr > 0:
        raise DPZooError(f"lr must be > 0, got {lr!r}.")
    if not max_grad_norm > 0:
        raise DPZooError(f"max_grad_norm must be > 0, got {max_grad_norm!r}.")
    if broken is not None and broken not in BROKEN:
        raise DPZooError(f"broken must be None or one of {', '.join(BROKEN)}, got {broken!r}.")
    if not 0 < confidence < 1:
        raise DPZooError(f"confidence must be in (0, 1), e.g. 0.95, got {confidence!r}.")
    if not guess_fractions or not all(0 < f <= 1 for f in guess_fractions):
        raise DPZooError(f"guess_fractions must be fractions of the canaries in (0, 1], got {guess_fractions!r}.")


def _validate_mechanism(noise_multiplier, sample_rate, steps) -> None:
    if noise_multiplier is not None and not (
        isinstance(noise_multiplier, (int, float)) and 0 < noise_multiplier < math.inf
    ):
        raise DPZooError(f"noise_multiplier must be a finite number > 0, got {noise_multiplier!r}.")
    if sample_rate is not None and not (isinstance(sample_rate, (int, float)) and 0 < sample_rate <= 1):
        raise DPZooError(f"sample_rate must be in (0, 1], got {sample_rate!r}.")
    if steps is not None and not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1):
        raise DPZooError(f"steps must be an integer >= 1, got {steps!r}.")


def _threat_model(threat_model: str, dataset) -> bool:
    """True for the white-box audit, after refusing what it cannot observe."""
    if threat_model not in ("black-box", "white-box"):
        raise DPZooError(f"threat_model must be 'black-box' or 'white-box', got {threat_model!r}.")
    if threat_model == "white-box" and dataset is not None:
        raise DPZooError(
            "threat_model='white-box' observes the built-in task's isolated canary coordinates; with your own "
            "dataset use the black-box audit."
        )
    return threat_model == "white-box"
