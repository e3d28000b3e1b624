"""Protocols between the privacy engine and the modules it trains.

:class:`NoiseAware`: a module that needs to know the DP noise the optimizer adds. When a model
is made private (``PrivacyEngine.make_private``), the engine walks ``model.modules()`` and calls
``set_dp_noise`` on every module that implements the protocol, with the noise multiplier σ, the
clipping norm R and the expected (Poisson) batch size B: the noise on the averaged gradient has
standard deviation σ·R/B. A module implements it by defining the method with this keyword-only
signature (no base class needed; ``isinstance(m, NoiseAware)`` checks it structurally). The call
may reach the same state twice (a model and its submodule both implementing it), so it must be
idempotent. DPFormer's Re-Attention (:class:`dpzoo.seqrec.reattention.ReAttention`) is one.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["NoiseAware", "notify_noise"]


@runtime_checkable
class NoiseAware(Protocol):
    """A module told the DP noise by the privacy engine (see the module docstring)."""

    def set_dp_noise(self, *, noise_multiplier: float, max_grad_norm: float, expected_batch_size: float) -> None:
        """Record the noise: multiplier σ, clipping norm R, expected batch size B (> 0)."""
        ...


def notify_noise(module, *, noise_multiplier: float, max_grad_norm: float, expected_batch_size: float) -> None:
    """Tell every :class:`NoiseAware` module of ``module`` (e.g. DPFormer's Re-Attention) what the
    optimizer adds: σ, R and the expected batch size."""
    for m in module.modules():  # idempotent: a module reached twice just sets it twice
        if isinstance(m, NoiseAware) and callable(m.set_dp_noise):  # the protocol checks the name only
            m.set_dp_noise(
                noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, expected_batch_size=expected_batch_size
            )
