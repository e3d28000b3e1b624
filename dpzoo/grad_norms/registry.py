"""Per-layer rules, registered by module type (like ``opacus.grad_sample``).

A rule is a plain function ``rule(module, activations, grad_output, params) -> {name: Rep}``:

* ``activations``: the module's positional inputs, detached (``None`` on the
  activation-free path, when every trainable parameter of the module is in
  ``activation_free``);
* ``grad_output``: ∂L/∂(module output), batch first;
* ``params``: the names of the module's own trainable parameters to return.

Each returned :class:`~dpzoo.grad_norms.reps.Rep` describes the per-sample gradients of one
parameter exactly. A subclass uses its parent's rule only if it does not override
``forward`` (it might compute something else: timm's ``StdConv2d`` standardises its weight,
``Conv2dSame`` pads inside ``forward``); otherwise it needs a rule of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from torch import nn

__all__ = ["register_rule", "find_rule", "Rule", "RULES"]


@dataclass(frozen=True)
class Rule:
    fn: Callable
    module_type: type
    params: tuple[str, ...]  # parameter names the rule covers
    activation_free: frozenset[str]  # parameters it can handle without activations
    check: Callable[[nn.Module], str | None] | None = None  # why a module is unsupported, or None
    # Activation-free path: the submodule whose *input* gradient is the gradient the rule
    # needs (e.g. a fused norm+activation: the activation's input), instead of the output's.
    grad_from: Callable[[nn.Module], nn.Module] | None = None

    def unsupported(self, module: nn.Module) -> str | None:
        return self.check(module) if self.check is not None else None


RULES: dict[type, Rule] = {}


def register_rule(*module_types: type, params: Iterable[str] = ("weight", "bias"),
                  activation_free: Iterable[str] = (), check: Callable[[nn.Module], str | None] | None = None,
                  grad_from: Callable[[nn.Module], nn.Module] | None = None):
    """Decorator: ``@register_rule(nn.Linear, activation_free={"bias"})``.

    ``check(module)`` returns why a particular module cannot be handled (e.g. an
    Embedding with ``max_norm``), or None; attaching hooks then raises with that reason.
    """
    def deco(fn):
        for t in module_types:
            RULES[t] = Rule(fn, t, tuple(params), frozenset(activation_free), check, grad_from)
        return fn
    return deco


def find_rule(module: nn.Module) -> Rule | None:
    """The rule registered for the module's type, or for a parent whose ``forward`` it keeps."""
    from . import rules  # noqa: F401  (registers the built-in rules)
    t = type(module)
    for cls in t.__mro__:
        if cls in RULES:
            return RULES[cls] if t.forward is cls.forward else None
        if cls is nn.Module:
            break
    return None
