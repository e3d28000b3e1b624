"""The model's parameters and buffers exactly as torch lists them (``module.parameters()``,
``module.named_buffers()``: each tensor once, depth first), gathered in one flat loop over the
module tree instead of torch's nested generators.

The guards (:mod:`dpzoo.privacy.guards`) walk the whole model before every training forward and
at every step. On a GPU a DP step is bound by its host time, and torch's walk costs several Python
calls per module (one generator frame per level of nesting): a dpzoo instantiation step of a
4-layer GPT-2 made 10,224 Python calls with torch's walks and 8,306 with this one (counted with
``sys.setprofile``, as benchmarks/cost_trace.py counts them). Where a module could make torch's
walk list something else (its class or the instance overrides a walk or how modules compare, as
PEFT's LoRA ``MultiheadAttention`` does to restore its weights; torch's own walk was patched; a
parameter or buffer compares by value), the model is walked by torch's own methods instead.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["named_modules", "parameters", "named_buffers", "WALKS"]

WALKS = ("named_modules", "_named_members", "named_parameters", "parameters", "named_buffers", "buffers",
          "modules", "children", "named_children", "__hash__", "__eq__")  # fmt: skip
_TORCH = {w: getattr(nn.Module, w) for w in WALKS}  # torch's own, as imported
_TENSOR_COMPARE = (torch.Tensor.__hash__, torch.Tensor.__eq__)


def _plain(cls: type) -> bool:
    """Whether ``cls`` keeps every one of torch's walks and its identity comparison."""
    for w in WALKS:
        if getattr(cls, w, None) is not _TORCH[w]:
            return False
    return True


def named_modules(module: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """``list(module.named_modules())``: each module once, depth first, named by its path. None if
    torch's walk could list something else here (the module docstring): then use torch's."""
    plain: dict[type, bool] = {}  # per walk: a class patched since the last walk is seen
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    stack = [("", module)]
    while stack:
        name, m = stack.pop()
        if id(m) in seen:
            continue
        cls = type(m)
        if cls not in plain:
            plain[cls] = _plain(cls)
        if not plain[cls] or not _WALK_NAMES.isdisjoint(m.__dict__):  # the class's, or the instance's own
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


_WALK_NAMES = frozenset(WALKS)


def _tensors(modules, members: str) -> dict[str, torch.Tensor] | None:
    """{name: tensor} of each module's ``members`` (``_parameters`` or ``_buffers``), each tensor
    once under its first name, as torch's ``_named_members``; None if one compares by value."""
    out, seen = {}, set()
    for prefix, m in modules:
        for key, t in getattr(m, members).items():
            if t is None or id(t) in seen:
                continue
            kind = type(t)
            if (
                kind is not nn.Parameter
                and kind is not torch.Tensor
                and (kind.__hash__, kind.__eq__) != _TENSOR_COMPARE
            ):
                return None
            seen.add(id(t))
            out[f"{prefix}.{key}" if prefix else key] = t
    return out


_WALK = object()  # not given: walk the model now


def parameters(module: nn.Module, modules=_WALK) -> list[nn.Parameter]:
    """``list(module.parameters())``; ``modules``: :func:`named_modules` of ``module`` taken at the
    same point (one walk for several reads), else walked now."""
    modules = named_modules(module) if modules is _WALK else modules
    found = None if modules is None or _patched() else _tensors(modules, "_parameters")
    return list(module.parameters()) if found is None else list(found.values())


def named_buffers(module: nn.Module, modules=_WALK) -> dict[str, torch.Tensor]:
    """``dict(module.named_buffers())``; ``modules`` as for :func:`parameters`."""
    modules = named_modules(module) if modules is _WALK else modules
    found = None if modules is None or _patched() else _tensors(modules, "_buffers")
    return dict(module.named_buffers()) if found is None else found


def _patched() -> bool:
    """Whether torch's walks were replaced since dpzoo was imported (then only torch's own walk is faithful)."""
    for w in WALKS:
        if getattr(nn.Module, w) is not _TORCH[w]:
            return True
    return False
