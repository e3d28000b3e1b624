"""The model's parameters and buffers exactly as torch lists them (``module.parameters()``,
``module.named_buffers()``: each tensor once, depth first), gathered in one flat loop over the
module tree instead of torch's nested generators.

The guards (:mod:`dpzoo.privacy.guards`) walk the whole model before every training forward and
at every step. On a GPU a DP step is bound by its host time, and torch's walk costs several Python
calls per module (one generator frame per level of nesting): a dpzoo instantiation step of a
4-layer GPT-2 made 10,224 Python calls with torch's walks and 8,250 with this one (counted with
``sys.setprofile``, as benchmarks/cost_trace.py counts them).
A module whose class overrides one of torch's walks (PEFT's ``ParamWrapper`` restores weights
when walked) is walked by torch's own methods instead.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["named_modules", "parameters", "named_buffers"]

_WALKS = ("named_modules", "_named_members", "named_parameters", "parameters", "named_buffers", "buffers")
_PLAIN: dict[type, bool] = {}  # module class -> whether it keeps every one of torch's walks


def _plain(cls: type) -> bool:
    plain = _PLAIN.get(cls)
    if plain is None:
        plain = _PLAIN[cls] = all(getattr(cls, w, None) is getattr(nn.Module, w) for w in _WALKS)
    return plain


def named_modules(module: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """``list(module.named_modules())``: each module once, depth first, named by its path. None if
    some module's class overrides torch's walks (then use torch's: :func:`parameters` does)."""
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    stack = [("", module)]
    while stack:
        name, m = stack.pop()
        if id(m) in seen:
            continue
        if not (_PLAIN.get(type(m)) or _plain(type(m))):  # the cached answer without a call
            return None
        seen.add(id(m))
        out.append((name, m))
        children = []
        for key, child in m._modules.items():
            if child is not None:
                children.append((f"{name}.{key}" if name else key, child))
        children.reverse()  # popped in registration order: depth first, as torch's recursion
        stack.extend(children)
    return out


def parameters(module: nn.Module) -> list[nn.Parameter]:
    """``list(module.parameters())``."""
    modules = named_modules(module)
    if modules is None:
        return list(module.parameters())
    out, seen = [], set()
    for _, m in modules:
        for p in m._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def named_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """``dict(module.named_buffers())``."""
    modules = named_modules(module)
    if modules is None:
        return dict(module.named_buffers())
    out, seen = {}, set()
    for prefix, m in modules:
        for key, b in m._buffers.items():
            if b is not None and id(b) not in seen:
                seen.add(id(b))
                out[f"{prefix}.{key}" if prefix else key] = b
    return out
