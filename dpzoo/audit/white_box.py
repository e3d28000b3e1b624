"""White-box scores: every noisy update of the canaries' own coordinates, observed at each step.

The threat model of DP-SGD's analysis (every privatized gradient is released), the one under
which an audit can come close to the claim (Nasr, Hayes, Steinke, Balle, Tramèr, Jagielski,
Carlini & Terzis, "Tight Auditing of Differentially Private Machine Learning", USENIX Security
2023, §4: gradient canaries, all iterates; the one-run estimator of Steinke, Nasr & Jagielski
2023 turns the scores into a bound). The built-in task's canary i is ``canary_norm`` times the
unit vector of input coordinate 64 + i, which no other example touches: only canary i's gradient
reaches its isolated coordinates (weight column 64 + i of the linear model, stored per training
mode by :mod:`dpzoo.audit.canary_models`), so their part of the noisy sum the engine releases at
step t is ``a_t·u_t·b_t + N(0, σ²R²·I)``, where ``u_t`` is the direction of the
canary's clipped gradient on those coordinates at the current weights (known to a white-box auditor),
``a_t`` its length under the *claimed* clipping, and ``b_t`` whether Poisson sampling drew it.

The score of canary i is the log-likelihood ratio of "in" against "out" for the claimed
Poisson-subsampled Gaussian over the whole run: Σ_t log(1 − q + q·exp((a_t z_t − a_t²/2)/(σR)²))
with z_t = ⟨column, u_t⟩. Under the claimed mechanism it is the optimal test per step; a
mechanism that adds more than R of a sample (a clipping bug) or less noise than σR separates the
in- and out-canaries' scores further than the claim allows, and the bound exceeds it.

At the user level a canary is a user of k identical examples. Sampled by users, the user's
gradient (k times one example's) is clipped as one: the same score with a_t for that sum. Sampled
by examples, each copy is drawn and clipped alone, j ~ Binomial(k, q) of them in a step, and the
score is the log-likelihood ratio of that mixture: log Σ_j P(j)·exp((j a_t z_t − (j a_t)²/2)/(σR)²).
"""

from __future__ import annotations

import math

import torch

from ..privacy.clipping import AUTOMATIC_GAMMA

__all__ = ["CanaryColumnScores", "column_observer", "EXACT"]


class CanaryColumnScores:
    """Accumulates each canary's log-likelihood-ratio score from the noisy sums on the canary
    model's isolated coordinates (:mod:`dpzoo.audit.canary_models`: ``canary_release()`` and
    ``canary_gradients()``), read in a step pre-hook of the optimizer that applies them (the DP
    optimizer has written the noisy gradient there, the weights are those it was computed at).

    A white-box auditor also sees a release that carries no noise at all: a canary whose column
    equals its clipped gradient to within :data:`EXACT_TOLERANCE` of its length (float rounding;
    under the claimed Gaussian a chance of about (1e-3/σ)^k for k coordinates, negligible) gets
    :data:`EXACT` added to its score, so a skipped noise draw is caught. Any score the auditor
    computes from the releases keeps the bound valid; this one only adds power."""

    def __init__(self, model, canary_y, *, claimed, examples: int = 1, per_example: bool = False):
        self.model, self.canary_y = model, canary_y
        self.examples, self.per_example = int(examples), bool(per_example)  # k copies; drawn one by one
        self.sigma, self.R = float(claimed["noise_multiplier"]), float(claimed["max_grad_norm"])
        self.q, self.clipping = float(claimed["sample_rate"]), claimed["clipping"]
        self.scale = float(claimed["sum_scale"])  # .grad × this = the noisy sum
        self.scores = torch.zeros(len(canary_y), dtype=torch.float64)
        self.steps = 0

    def attach(self, optimizer) -> None:
        """Observe every step of ``optimizer`` (a DP optimizer: its inner one, after the noise)."""
        inner = getattr(optimizer, "original_optimizer", optimizer)
        self.handle = inner.register_step_pre_hook(self.observe)

    def detach(self) -> None:
        self.handle.remove()

    @torch.no_grad()
    def observe(self, optimizer, args, kwargs) -> None:
        own, full = self.model.canary_gradients(self.canary_y)
        if not self.per_example:  # k identical examples clipped as one unit: k times one's gradient
            own, full = own * self.examples, full * self.examples
        release = self.model.canary_release()
        noisy = torch.zeros_like(own) if release is None else release * self.scale
        if self.clipping == "automatic":
            factor = self.R / (full + AUTOMATIC_GAMMA)
        else:
            factor = torch.clamp(self.R / full.clamp_min(1e-300), max=1.0)
        own_norm = own.norm(dim=1)
        length = factor * own_norm  # the clipped gradient's part on its own coordinates
        direction = own / own_norm.clamp_min(1e-300)[:, None]
        z = (noisy * direction).sum(1)
        s2 = (self.sigma * self.R) ** 2
        if s2 == 0:  # a claim of no noise: any observation is decisive; scores stay finite
            s2 = 1e-12
        counts = range(self.examples + 1) if self.per_example else (0, 1)
        log_in = torch.logsumexp(
            torch.stack([self._log_drawn(j, len(counts) - 1) + (j * length * z - (j * length) ** 2 / 2) / s2
                         for j in counts]), 0)  # fmt: skip
        exact = torch.zeros_like(z, dtype=torch.bool)
        for j in counts[1:]:  # a noiseless release: the column is j clipped copies exactly
            exact |= (noisy - j * length[:, None] * direction).norm(dim=1) <= EXACT_TOLERANCE * j * length
        self.scores += log_in + EXACT * (exact & (length > EXACT_TOLERANCE * self.R))
        self.steps += 1

    def _log_drawn(self, j: int, n: int) -> float:
        """log P(j of the canary's n independent draws at rate q are in this step's batch)."""
        log_q = math.log(self.q)
        log_out = math.log1p(-self.q) if self.q < 1 else -math.inf
        return math.log(math.comb(n, j)) + (j * log_q if j else 0.0) + ((n - j) * log_out if n - j else 0.0)


EXACT = 1e6  # the score a noiseless in-release adds: above any Gaussian evidence
EXACT_TOLERANCE = 1e-3  # float32 sums against float64 recomputation: far below one σR of noise


def column_observer(canary_y, observed: list):
    """The ``on_private`` callback of the training run: attaches a :class:`CanaryColumnScores` to
    the optimizer that applies the canary model's releases (appended to ``observed``)."""

    def attach(model, optimizer, claim) -> None:
        scores = CanaryColumnScores(model, canary_y, claimed=claim)
        scores.attach(optimizer)
        observed.append(scores)

    return attach
