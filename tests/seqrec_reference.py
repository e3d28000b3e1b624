"""Reference formulas the Re-Attention tests compare dpzoo against (test-only, not dpzoo's API).

* :func:`linear`: eq. 5.5 (Lemma D.1) per output coordinate: for y = W x + b,
  Var[y_o] = Σ_j (Var[x_j]·(W_oj² + var_w) + E[x_j]²·var_w) + var_b. dpzoo runs its average
  over the outputs (:func:`dpzoo.seqrec.reattention.iso_linear`).
* :func:`paper_eq_5_6`: eq. 5.6 exactly as printed. It subtracts c² (the squared *input* mean)
  where the variance subtracts E[ReLU(X)]²; the tests show it misses Monte-Carlo by far more
  than 5% where ReLU is active, while :func:`dpzoo.seqrec.reattention.relu` matches.
* :func:`elementwise` / :func:`gelu` / :func:`iso_gelu`: moments of a smooth activation by
  Gauss–Hermite quadrature (exact for polynomials of degree < 2·points, ~1e-7 for GELU/SiLU);
  the paper gives no closed form for GELU, and no dpzoo block uses one yet.
* :func:`reattention`: §5.2's correction on the probabilities, S_i ← S_i / exp(C·σ_i²/2) with
  C = ⟨q, q⟩, renormalised; dpzoo subtracts the equivalent term from the logits
  (:func:`dpzoo.seqrec.reattention.score_correction`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def linear(
    mean: torch.Tensor,
    var: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    var_w: float = 0.0,
    var_b: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, var) of y = x Wᵀ + b for x ~ N(mean, var) per coordinate, W with noise var_w."""
    out_mean = mean @ weight.t() + (bias if bias is not None else 0)
    out_var = var @ weight.pow(2).t() + var_w * (var + mean.pow(2)).sum(-1, keepdim=True) + var_b
    return out_mean, out_var


def paper_eq_5_6(c: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Eq. 5.6 exactly as printed (for comparison; see the module docstring)."""
    s = d.sqrt()
    phi_cdf = 0.5 * (1 + torch.erf(c / s / math.sqrt(2.0)))
    return phi_cdf * (c * c + d) + c * s / math.sqrt(2 * math.pi) * torch.exp(-0.5 * c * c / d) - c * c


_GH: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _gauss_hermite(points: int, dtype, device):
    if points not in _GH:
        import numpy as np

        x, w = np.polynomial.hermite.hermgauss(points)
        _GH[points] = (torch.tensor(x, dtype=torch.float64), torch.tensor(w, dtype=torch.float64))
    x, w = _GH[points]
    return x.to(dtype=dtype, device=device), w.to(dtype=dtype, device=device)


def elementwise(fn, c: torch.Tensor, d: torch.Tensor, points: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, var) of fn(X), X ~ N(c, d), by Gauss–Hermite quadrature."""
    x, w = _gauss_hermite(points, c.dtype, c.device)
    samples = c.unsqueeze(-1) + (2 * d).clamp_min(0).sqrt().unsqueeze(-1) * x
    fx = fn(samples)
    m1 = (fx * w).sum(-1) / math.sqrt(math.pi)
    m2 = (fx * fx * w).sum(-1) / math.sqrt(math.pi)
    return m1, (m2 - m1 * m1).clamp_min(0)


def gelu(c: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return elementwise(F.gelu, c, d)


def iso_gelu(pre: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """Per-token variance of GELU(pre) with per-coordinate variance ``var`` (averaged)."""
    return gelu(pre, var.unsqueeze(-1).expand_as(pre))[1].mean(-1)


def reattention(scores: torch.Tensor, key_var: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Debiased attention: softmax scores (…, T_q, T_k) divided by exp(C·σ_k²/2), C = ⟨q, q⟩, renormalised.

    ``key_var``: (…, T_k) variance σ_k² of each key (isotropic over its dimensions);
    ``q``: (…, T_q, d) queries. Padding keys (score 0) stay 0.
    """
    c = (q * q).sum(-1, keepdim=True)  # (…, T_q, 1)
    corrected = scores * torch.exp(-0.5 * c * key_var.unsqueeze(-2))
    return corrected / corrected.sum(-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)
