"""What is audited on: the built-in digits task with "Dirac" canaries, and the canary scores.

**Built-in default** (no download; a few seconds of training on 2 CPU cores): scikit-learn's
digits as 64-d vectors, extended by m coordinates; canary i is the vector with value
``canary_norm`` on coordinate 64 + i and zeros elsewhere ("Dirac" canary), with a random label.
Only canary i ever touches its coordinate, so the change of the model's output at the canary,
relative to the all-zero input, isolates what training did because of that canary
(:func:`logit_change_score`: the change of its label's logit minus the mean change of the other
logits). Without noise an out canary scores exactly 0 and an in canary (if Poisson sampling
drew it at least once) above 0; with DP noise the scores are noise-dominated. The model is a
linear classifier whose canary weights start at zero. Its m canary coordinates are stored
sparsely (the 64 pixels plus one slot naming the canary; :mod:`dpzoo.audit.canary_models`: an
embedding row per canary in place of the weight column, or a bias, or a LoRA-adapted column, per
training mode), so tens of thousands of canaries cost kilobytes, not an N × m input; the
function computed, and each sample's gradient, are those of the dense linear model. Any other task is scored black-box by :func:`loss_score` unless it brings its own score.

A score is the auditor's evidence in the one-run audit of Steinke, Nasr & Jagielski (2023),
Algorithm 1: higher means more likely trained on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from ..errors import DPZooError
from .canary_models import DiracCanaryClassifier, canary_model

__all__ = [
    "DIGITS_FEATURES",
    "DiracCanaryClassifier",
    "LinearClassifier",
    "digits_canary_task",
    "logit_change_score",
    "loss_score",
]

DIGITS_FEATURES = 64


class LinearClassifier(nn.Module):
    """A plain linear classifier (kept for user code; the built-in task uses :class:`DiracCanaryClassifier`)."""

    def __init__(self, in_features: int, num_classes: int = 10):
        super().__init__()
        self.fc = nn.Linear(in_features, num_classes)

    def forward(self, x):
        return self.fc(x)


def digits_canary_task(
    canaries: int, canary_norm: float = 1000.0, seed: int = 0, test_fraction: float = 0.2, mode: str = "auto"
):
    """The built-in audit task: (train, test, canary_x, canary_y, model_fn, score_fn).

    scikit-learn's digits as 64-d vectors in [0, 1]; canary i is ``canary_norm`` times the unit
    vector on coordinate 64 + i, with a random label. Rows are stored as :class:`DiracCanaryClassifier`
    reads them: the pixels and a canary slot (0 for the digits, i + 1 for canary i). ``model_fn``
    builds the canary model of the engine's ``mode`` (:func:`~dpzoo.audit.canary_models.canary_model`).
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise DPZooError("the built-in audit uses scikit-learn's digits: pip install scikit-learn") from None
    data = load_digits()
    g = torch.Generator().manual_seed(seed)
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=g)
    n_test = int(len(y) * test_fraction)
    x = torch.cat([x, torch.zeros(len(y), 1)], 1)  # slot 0: no canary
    test, train = perm[:n_test], perm[n_test:]
    canary_x = torch.zeros(canaries, DIGITS_FEATURES + 1)
    canary_x[:, DIGITS_FEATURES] = torch.arange(1, canaries + 1, dtype=torch.float32)
    canary_y = torch.randint(0, 10, (canaries,), generator=g)

    def model_fn():
        return canary_model(mode, DIGITS_FEATURES, canaries, canary_norm, 10)

    return (
        TensorDataset(x[train], y[train]),
        TensorDataset(x[test], y[test]),
        canary_x,
        canary_y,
        model_fn,
        logit_change_score,
    )


def logit_change_score(model: nn.Module, canary_x: torch.Tensor, canary_y: torch.Tensor) -> torch.Tensor:
    """Score of a "Dirac" canary: how much more the model's output at the canary favours its
    label than its output at the all-zero input does (the label's logit minus the mean of the
    others). Only canary i reaches its coordinate, so this is what training did because of it."""
    with torch.no_grad():
        out = model(canary_x) - model(torch.zeros_like(canary_x[:1]))
        k = out.shape[1]
        own = out.gather(1, canary_y[:, None]).squeeze(1)
        return own - (out.sum(1) - own) / (k - 1)


def loss_score(model: nn.Module, canary_x: torch.Tensor, canary_y: torch.Tensor) -> torch.Tensor:
    """Black-box score: minus the canary's cross-entropy loss (higher: more likely trained on)."""
    with torch.no_grad():
        return -F.cross_entropy(model(canary_x), canary_y, reduction="none")
