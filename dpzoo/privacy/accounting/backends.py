"""Accounting back-ends: ε at δ of a (σ, q, steps) history through dp-accounting or Opacus.

dpzoo computes no ε itself; every built-in accountant is one of these library calls:

* ``"rdp"``: Rényi DP of the Poisson-subsampled Gaussian (Mironov 2017; Mironov, Talwar &
  Zhang 2019), ``dp_accounting.rdp.RdpAccountant``;
* ``"pld"``: privacy loss distributions (Koskela et al. 2020; Doroshenko et al. 2022),
  ``dp_accounting.pld.PLDAccountant`` with its default pessimistic discretisation — tight; the one
  that also composes [σ, q, steps, k] entries (a user's k examples each sampled: a mixture of Gaussians);
  both from Google's dp-accounting, a core dependency (:func:`dp_accounting_epsilon`);
* ``"prv"``: privacy loss random variables (Gopi, Lee & Wutschitz 2021), Opacus'
  ``PRVAccountant`` (its ε upper bound);
* ``"opacus-rdp"``: Opacus' ``RDPAccountant`` (the same analysis as ``"rdp"``, Opacus' orders);
* ``"gdp"``: Opacus' ``GaussianAccountant``, Gaussian DP via the central limit theorem
  (Bu, Dong, Long & Su 2020). An *approximation*, not a bound (Opacus warns that it can
  underestimate ε), and it only reads the *last* (σ, q, steps) of a history
  (:func:`opacus_epsilon`; the registry marks it so, :mod:`dpzoo.privacy.accounting.registry`).

Opacus' accountants come with ``pip install "dpzoo[opacus]"``. The libraries are imported when ε
is asked for, not when this module is.
"""

from __future__ import annotations

import math
from typing import Callable

__all__ = ["dp_accounting_epsilon", "opacus_epsilon"]


def dp_accounting_epsilon(kind: str) -> Callable[[list, float], float]:
    """``epsilon(history, delta)`` through dp-accounting's ``PLDAccountant`` (``kind="pld"``) or
    ``RdpAccountant`` (any other ``kind``), composing every (σ, q, steps) entry of the history."""

    def epsilon(history: list, delta: float) -> float:
        from dp_accounting import dp_event

        if kind == "pld":
            from dp_accounting.pld.pld_privacy_accountant import PLDAccountant as Impl
        else:
            from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant as Impl
        grouped = any(len(h) > 3 for h in history)
        # mixtures of Gaussians are slow to discretise finely; 1e-3 keeps the bound pessimistic
        # (an upper bound) and moved ε by 2e-5 relative against 1e-4 (k = 4, σ = 1, q = 0.05, 1,000 steps)
        acc = Impl(value_discretization_interval=1e-3) if kind == "pld" and grouped else Impl()
        for sigma, q, steps, *group in history:
            acc.compose(_event(dp_event, sigma, q, group[0] if group else 1), steps)
        return float(acc.get_epsilon(delta))

    epsilon.__qualname__ = f"dp_accounting_{kind}_epsilon"
    return epsilon


def _event(dp_event, sigma: float, q: float, k: int):
    """One step: the Poisson-subsampled Gaussian, or for k > 1 the user-level mechanism of
    example-level sampling: j ~ Binomial(k, q) of a user's k examples are in the batch, each clipped
    to R, so the user shifts the noisy sum by at most j·R, a mixture of Gaussians N(j, σ²) against
    N(0, σ²) (Charles et al., SaTML 2025, §4, the tight ELS accountant; the mechanism of
    Choquette-Choo et al. 2024, arXiv 2310.15526, ``MixtureOfGaussiansDpEvent``)."""
    if k > 1:
        probs = [math.comb(k, j) * q**j * (1 - q) ** (k - j) for j in range(k + 1)]
        return dp_event.MixtureOfGaussiansDpEvent(sigma, [float(j) for j in range(k + 1)], probs)
    event = dp_event.GaussianDpEvent(sigma)
    return dp_event.PoissonSampledDpEvent(q, event) if q < 1 else event


def opacus_epsilon(kind: str) -> Callable[[list, float], float]:
    """``epsilon(history, delta)`` through the Opacus accountant ``create_accountant(kind)``
    (``"prv"``, ``"rdp"``, ``"gdp"``), handed the history as its own."""

    def epsilon(history: list, delta: float) -> float:
        from opacus.accountants import create_accountant

        acc = create_accountant(kind)
        acc.history = [tuple(h) for h in history]
        return float(acc.get_epsilon(delta))

    epsilon.__qualname__ = f"opacus_{kind}_epsilon"
    return epsilon
