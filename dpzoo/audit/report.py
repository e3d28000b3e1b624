"""What one audit reports: :class:`AuditResult` (claim, bound, verdict) and a histogram of its scores.

The bound is the one-run audit's (Steinke, Nasr & Jagielski 2023) or, in the white-box audit, the
larger of it and the Gaussian-DP estimator's (Nasr et al. 2023; ``estimator`` says which):
ε ≥ ``epsilon_lower_bound`` with probability ``confidence``; ``exceeds`` says whether it refutes
the claimed ε.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

__all__ = ["AuditResult", "plot_scores"]


@dataclass
class AuditResult:
    """What one audit measured. ``exceeds`` is True when the bound is above the claimed ε."""

    claimed_epsilon: float  # what the mechanism claims, at ``delta``
    delta: float
    epsilon_lower_bound: float  # empirical lower bound at ``confidence``
    confidence: float  # 1 - β, for the best of the tried guess counts (Bonferroni)
    canaries: int  # m
    guesses: int  # r = k_plus + k_minus of the best guess count
    correct: int  # v
    k_plus: int
    k_minus: int
    included: int  # canaries that were in the training set
    broken: str | None  # None: dpzoo's engine as is
    max_auditable_epsilon: float  # the bound if every guess were right: claims above it cannot be refuted
    estimator: str = "one-run"  # which estimator gave ``epsilon_lower_bound``: "one-run" or "gdp"
    estimators: dict = field(default_factory=dict)  # each estimator's bound and the confidence it was tested at
    mechanism: dict = field(default_factory=dict)  # σ, R, q, steps, epochs, lr, ...
    candidates: list = field(default_factory=list)  # every (k+, k-, v, bound) tried
    test_accuracy: float | None = None
    seconds: float = 0.0
    scores: list = field(default_factory=list, repr=False)
    membership: list = field(default_factory=list, repr=False)

    @property
    def exceeds(self) -> bool:
        return self.epsilon_lower_bound > self.claimed_epsilon

    @property
    def verdict(self) -> str:
        if self.exceeds:
            return "BOUND EXCEEDS CLAIM: the mechanism is not as private as claimed"
        return "bound below claim: consistent"

    def to_dict(self, scores: bool = True) -> dict:
        d = asdict(self)
        if not scores:
            d.pop("scores"), d.pop("membership")
        d["exceeds"], d["verdict"] = self.exceeds, self.verdict
        d["claimed_epsilon"] = self.claimed_epsilon if math.isfinite(self.claimed_epsilon) else None
        return d

    def lines(self) -> list[str]:
        mech = self.broken or "dpzoo engine"
        if self.mechanism.get("mode", "auto") != "auto":
            mech += f", mode {self.mechanism['mode']}"
        sigma = self.mechanism.get("noise_multiplier", float("nan"))
        claimed_sigma = self.mechanism.get("claimed_noise_multiplier", sigma)
        sigma_text = f"{sigma:.3g}" if sigma == claimed_sigma else f"{sigma:.3g} while claiming {claimed_sigma:.3g}"
        return [
            f"mechanism: {mech} (σ = {sigma_text}, "
            f"R = {self.mechanism.get('max_grad_norm')}, q = {self.mechanism.get('sample_rate', 0):.4f}, "
            f"{self.mechanism.get('steps')} steps)",
            f"claimed ε = {self.claimed_epsilon:.3f} at δ = {self.delta:g}",
            f"empirical lower bound ε ≥ {self.epsilon_lower_bound:.3f} at {100 * self.confidence:g}% confidence "
            f"(m = {self.canaries} canaries, {self.included} in; {self._evidence()}; "
            f"most this audit can show: {self.max_auditable_epsilon:.2f})",
            *self._estimator_lines(),
            self.verdict,
        ]

    def _evidence(self) -> str:
        if self.estimator == "gdp":
            g = self.estimators["gdp"]
            return f"Gaussian DP: μ ≥ {g['mu']:.3f} from FPR ≤ {g['fpr_upper']:.3f}, FNR ≤ {g['fnr_upper']:.3f}"
        return f"r = {self.guesses} guesses, v = {self.correct} correct"

    def _estimator_lines(self) -> list[str]:
        if len(self.estimators) < 2:
            return []
        names = {"one-run": "one-run (Steinke et al. 2023)", "gdp": "Gaussian DP (Nasr et al. 2023)"}
        parts = [f"{names.get(k, k)} ε ≥ {v['epsilon_lower_bound']:.3f}" for k, v in self.estimators.items()]
        level = next(iter(self.estimators.values()))["confidence"]
        return [f"  estimators, each at {100 * level:g}%: " + "; ".join(parts) + f"; reported: {self.estimator}"]


def plot_scores(result: AuditResult, path) -> bool:
    """Histogram of the in / out canaries' scores to ``path`` (PNG). False without matplotlib."""
    try:
        from matplotlib.figure import Figure  # no pyplot: leaves the user's backend alone
    except ImportError:
        return False
    scores, member = torch.tensor(result.scores), torch.tensor(result.membership, dtype=torch.bool)
    fig = Figure(figsize=(6, 3.5))
    ax = fig.subplots()
    bins = torch.linspace(float(scores.min()), float(scores.max()) + 1e-9, 41).tolist()
    ax.hist(scores[member].tolist(), bins=bins, alpha=0.6, label=f"in ({int(member.sum())})")
    ax.hist(scores[~member].tolist(), bins=bins, alpha=0.6, label=f"out ({int((~member).sum())})")
    ax.set_xlabel("canary score")
    ax.set_ylabel("canaries")
    ax.set_title(
        f"{result.broken or 'dpzoo engine'}: claimed ε = {result.claimed_epsilon:.2f}, "
        f"ε ≥ {result.epsilon_lower_bound:.2f} ({100 * result.confidence:g}%)",
        fontsize=9,
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True
