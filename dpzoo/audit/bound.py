"""The audit's statistics: a lower bound on ε from v correct guesses out of r (Steinke et al. 2023).

Under (ε, δ)-DP, with m canaries each included with probability 1/2, the paper's main theorem
bounds the probability of v or more correct guesses out of r:
P[v or more correct] ≤ f(v) + 2mδ · max_i (f(v-i) - f(v)) / i with
f(v) = P[Binomial(r, e^ε/(1+e^ε)) ≥ v] (:func:`one_run_p_value`). The bound on ε is the largest
ε that this rules out at level β (:func:`epsilon_lower_bound`). Binomial tails are computed
exactly in log space (no scipy); the implementation reproduces the worked values reported for
the paper's reference code (tests/test_audit.py).
"""

from __future__ import annotations

import math

from ..errors import DPZooError

__all__ = ["one_run_p_value", "epsilon_lower_bound"]


def _binomial_pmf(r: int, epsilon: float) -> list[float]:
    """P[Binomial(r, p) = k] for k = 0..r, p = e^ε / (1 + e^ε), exact in log space."""
    log_p = -math.log1p(math.exp(-epsilon))  # log(e^ε / (1 + e^ε))
    log_q = -epsilon - math.log1p(math.exp(-epsilon))  # log(1 / (1 + e^ε))
    lg = math.lgamma(r + 1)
    return [
        math.exp(lg - math.lgamma(k + 1) - math.lgamma(r - k + 1) + k * log_p + (r - k) * log_q) for k in range(r + 1)
    ]


def one_run_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Upper bound, under (ε, δ)-DP, on the probability of v or more correct guesses out of r.

    Steinke, Nasr & Jagielski (2023), main theorem of the one-run audit (the (ε, δ) version):
    f(v) + 2mδ · max_{1≤i≤v} (f(v-i) - f(v)) / i with f(v) = P[Binomial(r, e^ε/(1+e^ε)) ≥ v];
    m canaries, each included with probability 1/2. Clipped to 1.
    """
    _check_counts(m, r, v)
    if not (epsilon >= 0 and math.isfinite(epsilon)):
        raise DPZooError(f"epsilon must be finite and >= 0, got {epsilon}.")
    if not 0 <= delta < 1:
        raise DPZooError(f"delta must be in [0, 1), got {delta}.")
    if v == 0:
        return 1.0
    pmf = _binomial_pmf(r, epsilon)
    tail = math.fsum(pmf[v:])
    worst, below = 0.0, 0.0  # below = f(v-i) - f(v) = P[v-i ≤ B < v]
    for i in range(1, v + 1):
        below += pmf[v - i]
        worst = max(worst, below / i)
    return min(1.0, tail + 2 * m * delta * worst)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, beta: float = 0.05, tol: float = 1e-6) -> float:
    """The largest ε such that v correct guesses out of r reject (ε, δ)-DP at level β.

    The mechanism is not (ε', δ)-DP for any ε' below it, with confidence 1 - β (the one-run
    audit of Steinke, Nasr & Jagielski 2023). The p-value grows with ε, so bisection on
    :func:`one_run_p_value` finds it (to ``tol``; the lower end of the bracket is returned, so
    the bound never overstates). 0 when even ε = 0 is not rejected.
    """
    _check_counts(m, r, v)
    if not 0 < beta < 1:
        raise DPZooError(f"beta (1 - confidence) must be in (0, 1), got {beta}.")
    if one_run_p_value(m, r, v, 0.0, delta) > beta:
        return 0.0
    lo, hi = 0.0, 1.0
    while one_run_p_value(m, r, v, hi, delta) <= beta:
        lo, hi = hi, 2 * hi
        if hi > 1e4:  # not reached for finite r: the p-value tends to 1 as ε grows
            return lo
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if one_run_p_value(m, r, v, mid, delta) <= beta:
            lo = mid
        else:
            hi = mid
    return lo


def _check_counts(m, r, v):
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (m, r, v)):
        raise DPZooError(f"m, r, v must be integers, got m={m!r}, r={r!r}, v={v!r}.")
    if not 0 <= v <= r <= m or m < 1:
        raise DPZooError(f"need 0 <= v (correct) <= r (guesses) <= m (canaries) and m >= 1, got v={v}, r={r}, m={m}.")
