"""What the DP optimizer does with per-sample gradients of a scaled loss (float16 autocast with
:class:`~dpzoo.privacy.grad_scaler.DPGradScaler`): samples whose norm is not finite are dropped
(or refused without a scaler), and the self-check gets the output gradients of the unscaled loss;
torch's own GradScaler is refused.
"""

from __future__ import annotations

import torch

from ..errors import PrivacyUsageError

__all__ = ["nonfinite_samples", "unscaled_cotangents", "refuse_torch_grad_scaler"]


def nonfinite_samples(norms: torch.Tensor, drop: bool) -> torch.Tensor | None:
    """The samples (bool Tensor[B]) whose per-sample gradient norm is not finite, None if none.
    Without ``drop`` (no DPGradScaler) such a sample refuses the step: in float32 it means NaN or
    inf in the data or the model, which clipping cannot bound."""
    bad = ~torch.isfinite(norms)
    if not norms.numel() or not bad.any():
        return None
    if not drop:
        raise PrivacyUsageError(
            f"{int(bad.sum())} sample(s) of this batch have a non-finite gradient norm (NaN or inf in the data, the "
            "loss or the model, or a gradient norm above ~1e19 that overflows float32): clipping cannot bound them "
            "and the update would reveal them. Clean the data, or make the loss finite and bounded for every sample."
        )
    return bad


def unscaled_cotangents(cotangents: list[torch.Tensor] | None, scale: float) -> list[torch.Tensor] | None:
    """The output gradients of the unscaled loss, for the first-step self-check: in float32 or better
    (float16 would underflow), a non-finite entry (a dropped sample's) as 0."""
    if cotangents is None or scale == 1.0:
        return cotangents
    return [
        torch.nan_to_num(c.to(torch.promote_types(c.dtype, torch.float32)) / scale, nan=0.0, posinf=0.0, neginf=0.0)
        for c in cotangents
    ]


def refuse_torch_grad_scaler(optimizer) -> None:
    """Refuse a step that torch's GradScaler drives (it hands ``step()`` its state)."""
    if getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
        raise PrivacyUsageError(
            "torch's GradScaler is not supported: it skips steps and moves its scale on the non-private summed "
            "gradient, which the released model would reveal. For float16 use dpzoo.DPGradScaler(optimizer) "
            "(a fixed scale; a sample whose gradient overflows contributes 0), or bfloat16 autocast, which "
            "needs no scaler."
        )
