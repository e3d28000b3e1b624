"""DP-BiTFiT's trainable set: the biases, plus the classification head (DP-BiTFiT Alg. 1).

:func:`freeze_all_but_biases` applies it to a model; :func:`bitfit_trainable` only computes it
(``make_private`` checks the optimizer against it before freezing anything).
"""

from __future__ import annotations

import fnmatch
from typing import Iterable

from torch import nn

__all__ = [
    "freeze_all_but_biases",
    "default_head",
    "resolve_head",
    "bitfit_trainable",
    "is_bias_name",
    "head_parameters",
]


def is_bias_name(name: str) -> bool:
    """Whether a parameter name (``"encoder.0.bias"``, ``"in_proj_bias"``) is a bias DP-BiTFiT trains."""
    return name.rsplit(".", 1)[-1].endswith("bias")


def freeze_all_but_biases(model: nn.Module, train_head: Iterable[str] | str | None = None) -> list[str]:
    """DP-BiTFiT: only biases (and modules matching ``train_head`` patterns) stay trainable.

    Returns the names of the trainable parameters.
    """
    keep = bitfit_trainable(model, train_head)
    trainable = []
    for name, p in model.named_parameters():
        p.requires_grad_(id(p) in keep)
        if id(p) in keep:
            trainable.append(name)
    return trainable


def default_head(model: nn.Module) -> list[str]:
    """The head DP-BiTFiT trains besides the biases when ``train_head="auto"``: the classifier
    a timm ``pretrained_cfg`` names, else the first of ``classifier``, ``score``, ``fc``,
    ``head`` that is a module of ``model``; [] when there is none."""
    cfg = getattr(model, "pretrained_cfg", None) or {}
    if cfg.get("classifier"):
        return [cfg["classifier"]]
    for name in ("classifier", "score", "fc", "head"):
        if isinstance(getattr(model, name, None), nn.Module):
            return [name]
    return []


def resolve_head(model: nn.Module, train_head: Iterable[str] | str | None) -> Iterable[str] | str | None:
    """``train_head`` as patterns: ``"auto"`` becomes :func:`default_head`, anything else is kept."""
    return default_head(model) if train_head == "auto" else train_head


def head_parameters(model: nn.Module, train_head: Iterable[str] | str | None) -> set[int]:
    """ids of the parameters whose module name or own name matches a ``train_head`` pattern
    (``fnmatch``: ``"classifier"``, ``"head.*"``, ``"*.lm_head.weight"``); no mutation."""
    heads = [train_head] if isinstance(train_head, str) else list(train_head or [])
    keep = set()
    for name, p in model.named_parameters():
        module = name.rpartition(".")[0]
        if any(fnmatch.fnmatch(module, h) or fnmatch.fnmatch(name, h) for h in heads):
            keep.add(id(p))
    return keep


def bitfit_trainable(model: nn.Module, train_head) -> set[int]:
    """ids of the parameters DP-BiTFiT trains: biases and ``train_head`` patterns (no mutation)."""
    biases = {id(p) for name, p in model.named_parameters() if is_bias_name(name)}
    return biases | head_parameters(model, train_head)
