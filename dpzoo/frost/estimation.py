"""PGM-EST: maximum-likelihood estimates of the true PGMs from PSEL's noisy observations
(DP-FROST §4.5, Lemmas 4–6, App. C.2).

Model: at iteration t the observed noisy PGM of a remaining partition i is
v_{t,i} = λ_t ν_i + z, z ~ N(0, s_t²), where ν_i is the true PGM on the whole data, λ_t the
(unknown) scale of iteration t's sample (λ_1 = q_ps, which fixes the scale) and s_t = σ_ps·Δ_t.
The log-likelihood is maximised by alternating its closed-form coordinate maxima:

* Lemma 5 (ν given λ): ν_i = Σ_t w_t λ_t v_{t,i} / Σ_t w_t λ_t², over the iterations that
  observed i, with w_t = 1/s_t²;
* Lemma 4 (λ given ν): λ_t = Σ_i v_{t,i} ν_i / Σ_i ν_i², over the partitions observed at t.

With equal s_t (the paper's case) the weights cancel and these are Lemmas 4–5 as printed;
dpzoo's PSEL recomputes the sensitivity on the remaining partitions each iteration (Algorithm
4, line 4), so s_t can differ and the weights make the estimate the exact MLE. Lemma 6:
Var(ν_i) = 1 / Σ_t w_t λ_t².
"""

from __future__ import annotations

import torch

from ..errors import InvalidArgumentError

__all__ = ["pgm_est", "pgm_variance"]


def pgm_est(
    observed: torch.Tensor,
    mask: torch.Tensor,
    first_rate: float,
    noise_std: torch.Tensor | None = None,
    iterations: int = 1000,
    tol: float = 1e-12,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ν (M,), λ (T,)) from ``observed`` (T, M) noisy PGMs where ``mask`` (T, M) is True.

    Every partition must be observed at t = 1. ``noise_std`` (T,) gives s_t (default equal).
    """
    v = observed.double()
    m = mask.bool()
    t_count, _ = v.shape
    if not bool(m[0].all()):
        raise InvalidArgumentError(
            "pgm_est needs every partition observed in the first iteration: "
            "set mask[0] to all True (observe all partitions at t = 1)."
        )
    v = torch.where(m, v, torch.zeros_like(v))
    w = torch.ones(t_count, dtype=torch.float64) if noise_std is None else noise_std.double().pow(-2)
    if not torch.isfinite(w).all():  # zero noise: equal weights give the same (exact) fit
        w = torch.ones(t_count, dtype=torch.float64)
    lam = torch.full((t_count,), float(first_rate), dtype=torch.float64)
    mf = m.double()
    nu = v[0] / first_rate
    if t_count == 1:
        return nu, lam
    for _ in range(iterations):
        wl = (w * lam)[:, None] * mf
        nu_new = (wl * v).sum(0) / (wl * lam[:, None]).sum(0)  # Lemma 5
        den = (mf * nu_new.pow(2)).sum(1)
        lam_new = torch.where(den > 0, (mf * v * nu_new).sum(1) / den.clamp_min(1e-300), lam)  # Lemma 4
        lam_new[0] = first_rate
        done = (nu_new - nu).abs().max() <= tol * nu_new.abs().max().clamp_min(1e-300) and (
            lam_new - lam
        ).abs().max() <= tol * lam_new.abs().max()
        nu, lam = nu_new, lam_new
        if done:
            break
    return nu, lam


def pgm_variance(lam: torch.Tensor, mask: torch.Tensor, noise_std: torch.Tensor) -> torch.Tensor:
    """Lemma 6: Var(ν_i) = 1 / Σ_{t observed i} λ_t² / s_t² (0 when there is no noise)."""
    s2 = noise_std.double().pow(2)
    if bool((s2 == 0).all()):
        return torch.zeros(mask.shape[1], dtype=torch.float64)
    info = (mask.double() * (lam.double().pow(2) / s2)[:, None]).sum(0)
    return 1.0 / info
