"""Training modes of :class:`~dpzoo.PrivacyEngine`, defined once, with the parameter set each trains.

The engine (``make_private(mode=...)``, ``switch_mode``), ``dpzoo train --mode`` and the docs all
read :data:`TRAINING_MODES`. A mode names the per-sample-norm algorithm of
:func:`dpzoo.grad_norms.attach_norm_hooks` (``hooks``: ``"auto"``, ``"ghost"`` or
``"instantiate"``), whether only biases are trained (DP-BiTFiT), and ``trains``: the parameters
the mode trains, as a function ``trains(model, train_head) -> set of ids``, or None for "whatever
requires grad". :func:`mode_trainable` computes that set (no mutation; it refuses a model the mode
does not apply to) and :func:`apply_mode` freezes everything outside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

from torch import nn

from ..errors import PrivacyUsageError
from .bitfit import bitfit_trainable

__all__ = ["TrainingMode", "TRAINING_MODES", "MODES", "DEFAULT_CLI_MODE", "mode_trainable", "apply_mode"]


@dataclass(frozen=True)
class TrainingMode:
    """One training mode: its name, the norm-hook algorithm, bias-only training, a description,
    and the parameter set it trains (``trains(model, train_head)``: ids; None: those that
    require grad)."""

    name: str
    hooks: str
    bias_only: bool = False
    description: str = ""
    trains: Callable[[nn.Module, Any], set[int]] | None = None


def _bitfit(model: nn.Module, train_head) -> set[int]:
    """DP-BiTFiT's set (biases + head, DP-BiTFiT Alg. 1); on a PEFT model the head is PEFT's trained
    copy of it and the copies PEFT does not run (a wrapped head's original) are left out."""
    from ..integrations.peft_layers import inactive_parameters, train_head_patterns  # peft.py imports privacy

    return bitfit_trainable(model, train_head_patterns(model, train_head)) - inactive_parameters(model)


def _lora(model: nn.Module, train_head) -> set[int]:
    """DP-LoRA's set (:func:`dpzoo.integrations.peft.lora_trainable`)."""
    from ..integrations.peft_layers import lora_trainable  # peft.py imports privacy

    return lora_trainable(model, train_head)


TRAINING_MODES: dict[str, TrainingMode] = {
    m.name: m
    for m in (
        TrainingMode(
            "auto",
            "auto",
            description="ghost norm or per-sample instantiation per layer, whichever is faster within a memory budget (cost model)",
        ),
        TrainingMode("bk-mixopt", "auto", description="= auto (BK paper's name)"),
        TrainingMode("bk", "ghost", description="ghost norm on every generalised linear layer (BK paper §2–3)"),
        TrainingMode("instantiate", "instantiate", description="per-sample gradients everywhere (Opacus-style)"),
        TrainingMode(
            "bitfit",
            "auto",
            bias_only=True,
            description="only biases (plus train_head) are trained, activation-free (DP-BiTFiT Alg. 1)",
            trains=_bitfit,
        ),
        TrainingMode(
            "lora",
            "auto",
            description="only the LoRA adapters of a PEFT model are trained (plus its modules_to_save, the biases "
            "its bias= config names, and train_head); DP-LoRA",
            trains=_lora,
        ),
    )
}

# mode name -> norm-hook algorithm (what the engine hands attach_norm_hooks)
MODES: dict[str, str] = {name: m.hooks for name, m in TRAINING_MODES.items()}

DEFAULT_CLI_MODE = "bk-mixopt"


def _mode(mode: str) -> TrainingMode:
    if mode not in TRAINING_MODES:
        raise PrivacyUsageError(f"mode must be one of {', '.join(TRAINING_MODES)}, got {mode!r}")
    return TRAINING_MODES[mode]


def mode_trainable(mode: str, module: nn.Module, train_head: Iterable[str] | str | None = "auto") -> set[int]:
    """ids of the parameters ``mode`` trains on ``module`` (no mutation): the mode's own set
    (``"bitfit"``, ``"lora"``), else the parameters that require grad. Raises a
    :class:`~dpzoo.errors.DPZooError` for a model the mode does not apply to (``"lora"`` on a model
    without PEFT LoRA adapters)."""
    trains = _mode(mode).trains
    if trains is None:
        return {id(p) for p in module.parameters() if p.requires_grad}
    return trains(module, train_head)


def apply_mode(mode: str, module: nn.Module, train_head: Iterable[str] | str | None = "auto") -> list[str]:
    """Make exactly :func:`mode_trainable`'s parameters trainable (a mode without its own set
    leaves ``requires_grad`` as it is); returns the names of the trainable parameters."""
    if _mode(mode).trains is not None:
        keep = mode_trainable(mode, module, train_head)
        for p in module.parameters():
            p.requires_grad_(id(p) in keep)
    return [n for n, p in module.named_parameters() if p.requires_grad]
