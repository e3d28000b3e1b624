"""Steps 3-4 of the one-run canary audit from scores computed elsewhere: :func:`audit_from_scores`.

The one-run bound (Steinke, Nasr & Jagielski 2023, :mod:`.guesses`) and, white-box, the Gaussian-DP
bound (:mod:`.gdp`), each at half the error budget. Statistics only: no model, no training, so a
recorded audit can be recomputed from its saved scores (:mod:`.recorded`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..errors import DPZooError
from .gdp import gdp_lower_bound
from .guesses import DEFAULT_GUESS_FRACTIONS, best_guesses
from .report import AuditResult

__all__ = ["audit_from_scores"]


def audit_from_scores(
    scores: torch.Tensor,
    membership: torch.Tensor,
    *,
    claimed_epsilon: float,
    delta: float,
    confidence: float = 0.95,
    white_box: bool = False,
    mechanism: dict | None = None,
    broken: str | None = None,
    guess_fractions: Sequence[float] = DEFAULT_GUESS_FRACTIONS,
    seed: int = 0,
    test_accuracy: float | None = None,
    seconds: float = 0.0,
) -> AuditResult:
    """Steps 3–4 of the audit for scores computed elsewhere (e.g. a
    :class:`~dpzoo.audit.white_box.CanaryColumnScores` attached to your own training loop): the
    one-run bound, and with ``white_box`` the Gaussian-DP bound too, each at half the error
    budget so that the larger one holds at ``confidence`` (the Gaussian-DP bound under its own
    assumptions, :mod:`dpzoo.audit.gdp`; the one-run bound needs none). ``membership``: which canaries were in
    the training set (drawn independently with probability 1/2, before training)."""
    scores, included = torch.as_tensor(scores).double().flatten(), torch.as_tensor(membership, dtype=torch.bool)
    if scores.shape != included.shape or not torch.isfinite(scores).all():
        raise DPZooError(
            f"need one finite score per canary: {tuple(scores.shape)} scores for {tuple(included.shape)} canaries."
        )
    tie = torch.Generator().manual_seed(seed + 2)
    # white-box: two estimators, each at half the error budget, so the larger bound holds at `confidence`
    each = 1 - (1 - confidence) / 2 if white_box else confidence
    candidates, best, max_auditable = best_guesses(scores, included, delta, each, guess_fractions, tie)
    estimators = {
        "one-run": {
            "epsilon_lower_bound": best["epsilon_lower_bound"],
            "confidence": each,
            "max_auditable_epsilon": max_auditable,
        }
    }
    if white_box:
        gdp = gdp_lower_bound(scores, included, delta, each)
        estimators["gdp"] = gdp | {"confidence": each}
        max_auditable = max(max_auditable, gdp["max_auditable_epsilon"])
    reported = max(estimators, key=lambda k: estimators[k]["epsilon_lower_bound"])
    return AuditResult(
        claimed_epsilon=claimed_epsilon,
        delta=delta,
        epsilon_lower_bound=estimators[reported]["epsilon_lower_bound"],
        confidence=confidence,
        estimator=reported,
        estimators=estimators,
        canaries=len(scores),
        guesses=best["k_plus"] + best["k_minus"],
        correct=best["correct"],
        k_plus=best["k_plus"],
        k_minus=best["k_minus"],
        included=int(included.sum()),
        broken=broken,
        max_auditable_epsilon=max_auditable,
        mechanism=mechanism or {},
        candidates=candidates,
        test_accuracy=test_accuracy,
        seconds=seconds,
        scores=scores.tolist(),
        membership=included.tolist(),
    )
