"""A second estimator for the white-box audit: the Gaussian-DP bound from canary scores.

Nasr, Hayes, Steinke, Balle, Tramèr, Jagielski, Carlini & Terzis, "Tight Auditing of
Differentially Private Machine Learning" (USENIX Security 2023, §3.2 and Eq. 4–6 of Dong, Roth &
Su's "Gaussian Differential Privacy", JRSS-B 2022): at a threshold t, the test "score ≥ t means
in" has a false-positive rate FPR (out-canaries above t) and a false-negative rate FNR
(in-canaries below t). A μ-GDP mechanism forces FNR ≥ Φ(Φ⁻¹(1 − FPR) − μ), so
μ ≥ Φ⁻¹(1 − FPR) − Φ⁻¹(FNR) for any pair of rates it allows. Clopper–Pearson upper bounds on
both rates, at every threshold the scores offer (Bonferroni over all of them), give a lower bound
on μ at the stated confidence; it is converted to ε at δ with the GDP formula
δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) (Dong et al., Cor. 2.13).

What it assumes, reported with it (:func:`gdp_lower_bound`):

* Each canary is an independent trial. Exact for the out-canaries of the white-box task (their
  weight columns receive only the engine's noise, independent per coordinate); approximate for
  the in-canaries, whose clipped gradients depend on the shared trajectory.
* The mechanism's trade-off curve has the Gaussian shape: DP-SGD's composition tends to it
  (Dong et al., Thm. 3.5, the central limit theorem for f-DP); with few sampled steps per
  canary the curve is flatter in the middle, and this estimator under-reads ε there.

Neither assumption is needed by the one-run bound (:mod:`dpzoo.audit.bound`), which is weaker.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy import optimize, stats

__all__ = ["clopper_pearson_upper", "gdp_epsilon", "gdp_lower_bound"]


def clopper_pearson_upper(k: int, n: int, alpha: float) -> float:
    """One-sided Clopper–Pearson upper bound on a rate: k successes in n trials, level alpha."""
    return float(_clopper_pearson_uppers(np.array([k]), n, alpha)[0])


def _clopper_pearson_uppers(k: np.ndarray, n: int, alpha: float) -> np.ndarray:
    below = k < n
    return np.where(below, stats.beta.ppf(1 - alpha, k + 1, np.where(below, n - k, 1)), 1.0)


def gdp_epsilon(mu: float, delta: float) -> float:
    """ε at δ of a μ-GDP mechanism (Dong, Roth & Su 2022, Cor. 2.13); 0 when μ ≤ 0."""
    if not mu > 0:
        return 0.0

    def excess(eps: float) -> float:
        # log(Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2)) − log δ, in log space: both terms are tiny at large ε
        a = stats.norm.logcdf(-eps / mu + mu / 2)
        b = eps + stats.norm.logcdf(-eps / mu - mu / 2)
        return a + math.log1p(-math.exp(min(0.0, b - a))) - math.log(delta) if b < a else -math.inf

    if excess(0.0) <= 0:
        return 0.0
    hi = 1.0
    while excess(hi) > 0:
        hi *= 2
    return float(optimize.brentq(excess, hi / 2 if hi > 1 else 0.0, hi, xtol=1e-6))


def gdp_lower_bound(scores: torch.Tensor, included: torch.Tensor, delta: float, confidence: float) -> dict:
    """The largest μ (and its ε at δ) that the scores rule out at ``confidence``, over every
    threshold the scores offer (each of the 2·n Clopper–Pearson bounds at (1 − confidence)/(2n)).

    Returns ``{"mu", "epsilon_lower_bound", "threshold", "fpr_upper", "fnr_upper",
    "max_auditable_epsilon"}``; the last is the bound if the scores separated in- and out-canaries
    perfectly: claims above it cannot be refuted with this many canaries.
    """
    s_in = scores[included].double().sort().values
    s_out = scores[~included].double().sort().values
    n_in, n_out = len(s_in), len(s_out)
    thresholds = torch.cat([scores.double().unique(), torch.tensor([math.inf], dtype=torch.float64)])
    alpha = (1 - confidence) / (2 * len(thresholds))
    fn = torch.searchsorted(s_in, thresholds)  # in-canaries below t
    fp = n_out - torch.searchsorted(s_out, thresholds)  # out-canaries at or above t
    fpr = _clopper_pearson_uppers(fp.numpy(), n_out, alpha)
    fnr = _clopper_pearson_uppers(fn.numpy(), n_in, alpha)
    usable = (fpr < 1) & (fnr < 1)
    mus = np.where(usable, stats.norm.isf(np.where(usable, fpr, 0.5)) - stats.norm.ppf(np.where(usable, fnr, 0.5)), 0)
    i = int(np.argmax(mus))
    best = {"mu": 0.0, "threshold": None, "fpr_upper": None, "fnr_upper": None}
    if mus[i] > 0:
        best = {
            "mu": float(mus[i]),
            "threshold": float(thresholds[i]),
            "fpr_upper": float(fpr[i]),
            "fnr_upper": float(fnr[i]),
        }
    perfect = float(
        stats.norm.isf(clopper_pearson_upper(0, n_out, alpha)) - stats.norm.ppf(clopper_pearson_upper(0, n_in, alpha))
    )
    best["epsilon_lower_bound"] = gdp_epsilon(best["mu"], delta)
    best["max_auditable_epsilon"] = gdp_epsilon(perfect, delta)
    return best
