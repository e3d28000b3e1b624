"""Training modes of :class:`~dpzoo.PrivacyEngine`, defined once.

The engine (``make_private(mode=...)``, ``switch_mode``), ``dpzoo train --mode`` and the docs all
read :data:`TRAINING_MODES`. A mode names the per-sample-norm algorithm of
:func:`dpzoo.grad_norms.attach_norm_hooks` (``hooks``: ``"auto"``, ``"ghost"`` or
``"instantiate"``) and whether only biases are trained (DP-BiTFiT).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TrainingMode", "TRAINING_MODES", "MODES", "DEFAULT_CLI_MODE"]


@dataclass(frozen=True)
class TrainingMode:
    """One training mode: its name, the norm-hook algorithm, bias-only training, a description."""

    name: str
    hooks: str
    bias_only: bool = False
    description: str = ""


TRAINING_MODES: dict[str, TrainingMode] = {
    m.name: m
    for m in (
        TrainingMode(
            "auto",
            "auto",
            description="ghost norm or per-sample instantiation per layer, whichever is cheaper (2T² < p·d)",
        ),
        TrainingMode("bk-mixopt", "auto", description="= auto (BK paper's name)"),
        TrainingMode("bk", "ghost", description="ghost norm on every generalised linear layer (BK paper §2–3)"),
        TrainingMode("instantiate", "instantiate", description="per-sample gradients everywhere (Opacus-style)"),
        TrainingMode(
            "bitfit",
            "auto",
            bias_only=True,
            description="only biases (plus train_head) are trained, activation-free (DP-BiTFiT Alg. 1)",
        ),
    )
}

# mode name -> norm-hook algorithm (what the engine hands attach_norm_hooks)
MODES: dict[str, str] = {name: m.hooks for name, m in TRAINING_MODES.items()}

DEFAULT_CLI_MODE = "bk-mixopt"
