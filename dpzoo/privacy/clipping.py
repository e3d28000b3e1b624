"""Per-sample clipping functions: the factors C_i that bound each sample's gradient norm by R.

Abadi et al. (DP-SGD, Algorithm 1) clip by min(1, R/‖g_i‖), computed as R / max(‖g_i‖, R): the
closed form itself (no division by zero since R > 0; Opacus adds 1e-6 to the norm instead, which
changes every clipped factor by up to 1e-6/‖g_i‖ and protects against no rounding). Automatic
clipping (Bu et al., AUTO-S, eq. 4.1) scales by R/(‖g_i‖ + γ) with γ = :data:`AUTOMATIC_GAMMA`.
"""

from __future__ import annotations

import torch

from ..errors import PrivacyUsageError

__all__ = ["CLIPPING", "AUTOMATIC_GAMMA", "clip_factors"]

CLIPPING = ("abadi", "automatic")
AUTOMATIC_GAMMA = 0.01  # stability constant of automatic clipping (Bu et al., AUTO-S)


def clip_factors(norms: torch.Tensor, max_grad_norm: float, clipping: str) -> torch.Tensor:
    """C_i with ‖C_i g_i‖ ≤ R: Abadi min(1, R/‖g‖) or automatic R/(‖g‖ + 0.01)."""
    if clipping == "abadi":
        return max_grad_norm / norms.clamp(min=max_grad_norm)
    if clipping == "automatic":
        return max_grad_norm / (norms + AUTOMATIC_GAMMA)
    raise PrivacyUsageError(f"clipping must be one of {CLIPPING}, got {clipping!r}")
