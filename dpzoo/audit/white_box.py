"""White-box scores: every noisy update of the canaries' own coordinates, observed at each step.

The threat model of DP-SGD's analysis (every privatized gradient is released), the one under
which an audit can come close to the claim (Nasr, Hayes, Steinke, Balle, Tramèr, Jagielski,
Carlini & Terzis, "Tight Auditing of Differentially Private Machine Learning", USENIX Security
2023, §4: gradient canaries, all iterates; the one-run estimator of Steinke, Nasr & Jagielski
2023 turns the scores into a bound). The built-in task's canary i is ``canary_norm`` times the
unit vector of input coordinate 64 + i, which no other example touches: in the linear model only
canary i's gradient reaches weight column 64 + i (row i of the sparse model's canary embedding), so that column of the noisy sum the engine
releases at step t is ``a_t·u_t·b_t + N(0, σ²R²·I)``, where ``u_t`` is the direction of the
canary's clipped gradient on its column at the current weights (known to a white-box auditor),
``a_t`` its length under the *claimed* clipping, and ``b_t`` whether Poisson sampling drew it.

The score of canary i is the log-likelihood ratio of "in" against "out" for the claimed
Poisson-subsampled Gaussian over the whole run: Σ_t log(1 − q + q·exp((a_t z_t − a_t²/2)/(σR)²))
with z_t = ⟨column, u_t⟩. Under the claimed mechanism it is the optimal test per step; a
mechanism that adds more than R of a sample (a clipping bug) or less noise than σR separates the
in- and out-canaries' scores further than the claim allows, and the bound exceeds it.
"""

from __future__ import annotations

import math

import torch

__all__ = ["CanaryColumnScores", "column_observer"]


class CanaryColumnScores:
    """Accumulates each canary's log-likelihood-ratio score from the noisy sums of the built-in
    model's canary weights (:class:`~dpzoo.audit.task.DiracCanaryClassifier`: canary i's weight
    column is row i of ``model.canaries``), read in a step pre-hook of the engine's inner optimizer
    (the DP optimizer has written the noisy gradient there, the weights are those it was computed
    at)."""

    def __init__(self, model, canary_y, *, claimed):
        self.weight, self.bias, self.x_norm = model.canaries.weight, model.fc.bias, model.canary_norm
        self.canary_y = canary_y
        self.sigma, self.R = float(claimed["noise_multiplier"]), float(claimed["max_grad_norm"])
        self.q, self.clipping = float(claimed["sample_rate"]), claimed["clipping"]
        self.scale = float(claimed["sum_scale"])  # .grad × this = the noisy sum
        self.scores = torch.zeros(len(canary_y), dtype=torch.float64)
        self.steps = 0

    def attach(self, dp_optimizer) -> None:
        self.handle = dp_optimizer.original_optimizer.register_step_pre_hook(self.observe)

    def detach(self) -> None:
        self.handle.remove()

    @torch.no_grad()
    def observe(self, optimizer, args, kwargs) -> None:
        grad = self.weight.grad
        noisy = torch.zeros(self.weight.shape[1], len(self.canary_y), dtype=torch.float64)
        if grad is not None:
            noisy = grad.T.double() * self.scale  # (classes, m): canary i's column
        direction, length = self.canary_gradients()
        z = (noisy * direction).sum(0)
        s2 = (self.sigma * self.R) ** 2
        if s2 == 0:  # a claim of no noise: any observation is decisive; scores stay finite
            s2 = 1e-12
        log_in = math.log(self.q) + (length * z - length**2 / 2) / s2
        if self.q < 1:  # Poisson sampling may have left the canary out of this step
            log_in = torch.logaddexp(torch.full_like(log_in, math.log1p(-self.q)), log_in)
        self.scores += log_in
        self.steps += 1

    def canary_gradients(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per canary: the unit direction of its clipped gradient on its own column, and that part's
        length under the claimed clipping (R and the clipping rule the claim was made for)."""
        y = self.canary_y
        # the linear model at a Dirac input: its column times the norm, plus the bias (no m × d forward)
        logits = self.weight.double() * self.x_norm + self.bias.double()
        residual = torch.softmax(logits, 1) - torch.nn.functional.one_hot(y, logits.shape[1]).double()
        r_norm = residual.norm(dim=1)
        full = r_norm * math.sqrt(self.x_norm**2 + 1)  # weight column and bias together
        if self.clipping == "automatic":
            factor = self.R / (full + 0.01)
        else:
            factor = torch.clamp(self.R / full.clamp_min(1e-300), max=1.0)
        direction = (residual / r_norm.clamp_min(1e-300)[:, None]).T  # (classes, m)
        return direction, factor * r_norm * self.x_norm


def column_observer(canary_y, observed: list):
    """The ``on_private`` callback of the training run: attaches a :class:`CanaryColumnScores` on
    the built-in model's canary weights (appended to ``observed``)."""

    def attach(model, optimizer, claim) -> None:
        scores = CanaryColumnScores(model, canary_y, claimed=claim)
        scores.attach(optimizer)
        observed.append(scores)

    return attach
