"""Float16 loss scaling that keeps the privacy guarantee: :class:`DPGradScaler`.

Float16 autocast needs the loss multiplied by a scale S before backward, or small gradients
underflow to zero. ``torch.amp.GradScaler`` does this and also skips a step, and halves S,
whenever the *summed* gradient overflows, then grows S again after ``growth_interval`` clean
steps. Under DP both moves are functions of raw private data outside any mechanism: the skip
is visible in the released model, every later S depends on which earlier batches overflowed,
and a sample crafted to overflow would reveal its presence. dpzoo refuses that scaler
(``DPOptimizer.step``).

:class:`DPGradScaler` keeps the same calls (``scale(loss).backward()``, ``step(optimizer)``,
``update()``) with two changes that keep the DP-SGD analysis intact:

* **The scale is fixed.** ``update()`` never moves it on the data; ``update(new_scale)`` sets
  one the user chose, which must come from public information (the privacy analysis assumes
  it does; the :attr:`nonfinite_samples` count is private and must not be used to pick it).
* **A sample that overflows contributes 0.** The optimizer divides S out of the per-sample
  norms and the clipped sum (both are linear in the loss; for S a power of two this is exact),
  and a sample whose scaled gradient is not finite gets clip factor 0 with its rows of every
  layer's representation zeroed before the book-kept sum (``grad_norms.reps.without_samples``;
  0 · inf would poison the sum). Dropping a sample is a per-sample function of that sample
  alone, like clipping, so each sample still moves the sum by at most R: the sensitivity, the
  noise and the accounting are unchanged, and the step is always taken. What it costs is
  utility (the dropped samples' signal), so the default scale, 2¹², sits in the middle of the
  range ``GradScaler`` usually settles in (2¹⁰–2¹⁶) rather than at its optimistic start, 2¹⁶.

Without a ``DPGradScaler`` a non-finite per-sample gradient still refuses the step (in float32
it means NaN or inf in the data or the model, which must be fixed, not hidden).

Design decision, recorded in docs/DESIGN.md "Mixed precision": a data-driven scale would need
its overflow signal released through a mechanism (the count of overflowing samples plus noise,
accounted as a second query per step); a fixed scale costs no privacy and, with per-sample
dropping, no step is ever lost, so dpzoo ships the fixed one.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import InvalidArgumentError, PrivacyUsageError
from .optimizer import DPOptimizer
from .scaled_samples import nonfinite_samples, unscaled_cotangents

__all__ = [
    "DPGradScaler",
    "DEFAULT_LOSS_SCALE",
    "MIN_LOSS_SCALE",
    "MAX_LOSS_SCALE",
    "nonfinite_samples",
    "unscaled_cotangents",
]

DEFAULT_LOSS_SCALE = 2.0**12
MIN_LOSS_SCALE, MAX_LOSS_SCALE = 1.0, 2.0**24


def _checked_scale(value: Any, what: str) -> float:
    """A scale in [MIN_LOSS_SCALE, MAX_LOSS_SCALE]. Below 1 the squared norms of the scaled gradients
    underflow in float32 long before the linear clipped sum does: a norm would read 0 and the sample
    go unclipped. Above 2^24 float16 overflows for every gradient element over 2^-8."""
    try:
        scale = math.nan if isinstance(value, bool) else float(value)
    except (TypeError, ValueError, RuntimeError):
        scale = math.nan
    if not MIN_LOSS_SCALE <= scale <= MAX_LOSS_SCALE:
        raise InvalidArgumentError(f"{what} must be a number in [1, 2**24] (e.g. 2.0**12), got {value!r}")
    return scale


class DPGradScaler:
    """Loss scaling for float16 autocast under a dpzoo :class:`~dpzoo.privacy.DPOptimizer`.

    >>> scaler = dpzoo.DPGradScaler(optimizer)            # the optimizer make_private returned
    >>> with torch.autocast("cuda", dtype=torch.float16):
    ...     loss = criterion(model(x), y)
    >>> scaler.scale(loss).backward()
    >>> scaler.step(optimizer)                             # always steps (never skips)
    >>> scaler.update()                                    # the scale stays fixed

    ``enabled=False`` makes every call a pass-through (as torch's ``GradScaler``), so one loop
    serves float32 and float16.
    """

    def __init__(self, optimizer: DPOptimizer, init_scale: float = DEFAULT_LOSS_SCALE, *, enabled: bool = True):
        if not isinstance(optimizer, DPOptimizer):
            raise PrivacyUsageError(
                f"DPGradScaler needs the DPOptimizer that dpzoo's make_private returned, got "
                f"{type(optimizer).__name__}: the scale must be divided out of each sample's clipped gradient."
            )
        self.optimizer = optimizer
        self._enabled = bool(enabled)
        self._scale = _checked_scale(init_scale, "init_scale")
        if self._enabled:
            optimizer.drop_nonfinite = True

    def scale(self, outputs):
        """``outputs`` (a tensor or a list / tuple of them) times the scale; tells the optimizer
        the scale these gradients will carry."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        if not isinstance(outputs, torch.Tensor):  # refused before the optimizer is told anything
            raise InvalidArgumentError(
                f"scale() takes a tensor or a list / tuple of them, got {type(outputs).__name__}"
            )
        self.optimizer.loss_scale = self._scale
        return outputs * self._scale

    def unscale_(self, optimizer) -> None:
        """Refused: before ``step()`` the ``.grad`` tensors are not the private gradient."""
        raise PrivacyUsageError(
            "DPGradScaler.unscale_ is not available: dpzoo clips each sample's gradient and writes the private, "
            "unscaled .grad inside step(), so there is nothing to unscale before it. Drop the unscale_ / "
            "clip_grad_norm_ lines: max_grad_norm of make_private is the clipping."
        )

    def step(self, optimizer, *args, **kwargs):
        """``optimizer.step()``: clips (dividing the scale out), adds noise and steps, every time."""
        if optimizer is not self.optimizer:
            raise PrivacyUsageError(
                "DPGradScaler.step got another optimizer than the one it was built with: build one scaler per "
                "DPOptimizer."
            )
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Keep the scale (it never moves on the data), or set ``new_scale``, which must be
        chosen from public information (it takes effect at the next :meth:`scale`)."""
        if new_scale is not None and self._enabled:
            self._scale = _checked_scale(new_scale, "new_scale")

    def get_scale(self) -> float:
        return self._scale if self._enabled else 1.0

    def is_enabled(self) -> bool:
        return self._enabled

    @property
    def nonfinite_samples(self) -> int:
        """Samples dropped so far because their scaled gradient was not finite. A count over
        private data, for the curator's diagnostics only: releasing it or choosing the scale from
        it would fall outside the privacy guarantee."""
        return self.optimizer.nonfinite_samples

    def state_dict(self) -> dict:
        return {"scale": self._scale, "enabled": self._enabled} if self._enabled else {}

    def load_state_dict(self, state: dict) -> None:
        if not self._enabled:
            return
        if "scale" not in state:
            raise InvalidArgumentError("not a DPGradScaler state dict (no 'scale'): pass scaler.state_dict()")
        self._scale = _checked_scale(state["scale"], "the state dict's scale")

    def __repr__(self) -> str:
        return f"DPGradScaler(scale={self.get_scale():g}, fixed, enabled={self._enabled})"
