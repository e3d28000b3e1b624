"""Per-layer rules, registered by module type (like ``opacus.grad_sample``).

A rule is a plain function ``rule(module, activations, grad_output, params) -> {name: Rep}``:

* ``activations``: the module's positional inputs, detached (``None`` on the
  activation-free path, when every trainable parameter of the module is in
  ``activation_free``);
* ``grad_output``: ∂L/∂(module output), batch first;
* ``params``: the names of the module's own trainable parameters to return.

Each returned :class:`~dpzoo.grad_norms.reps.Rep` describes the per-sample gradients of one
parameter exactly, *for the computation the registered class performs*. A rule is therefore
tied to the methods that computation runs: ``forward`` always, plus those declared with
``register_rule(..., methods=(...))`` (``_conv_forward`` for the convolutions, ``normalize``
for dpzoo's RMSNorm). A module gets the rule of the nearest registered class in its MRO only if

* no class between its own type and that registered class overrides one of these methods
  (timm's ``StdConv2d`` standardises its weight in ``forward``; a weight-standardising Conv2d
  may do it in ``_conv_forward``);
* the module instance does not carry one of them as an attribute of its own
  (``layer.forward = fn``, a ``functools.partial``, a bound method of another object);
* the registered class's own methods are still those it had when the rule was registered
  (no monkeypatching of, e.g., ``nn.Linear.forward``).

Otherwise :func:`find_rule` returns None (:func:`why_no_rule` says why) and attaching hooks
refuses the module. ``register_rule(SubClass)`` registers a rule for a subclass explicitly.
The check is repeated each time a rule runs, so a method replaced on an instance after the
hooks were attached is refused too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Iterable

from torch import nn

from ..errors import UnsupportedModuleError

__all__ = ["register_rule", "find_rule", "why_no_rule", "Rule", "RULES"]

_MISSING = object()


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
    # The methods the rule's computation relies on ("forward" first), and their
    # implementations on ``module_type`` when the rule was registered.
    methods: tuple[str, ...] = ("forward",)
    impls: tuple = field(default=(), compare=False, repr=False)
    # The rule's factors are its inputs reshaped, no arithmetic: a layer that ran in half
    # precision hands them over in it (:func:`dpzoo.grad_norms.assembly.rule_operands`)
    half_factors: bool = False

    def unsupported(self, module: nn.Module) -> str | None:
        return self.check(module) if self.check is not None else None


RULES: dict[type, Rule] = {}


def _static(cls: type, name: str):
    """``name`` as the class ``cls`` defines or inherits it, without invoking descriptors: the
    first class of its MRO that has it (``inspect.getattr_static`` for a class, minus the metaclass
    lookup no method name needs; five times fewer Python calls: the rules run it every step)."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    return _MISSING


def _mismatch(module: nn.Module, rule: Rule) -> str | None:
    """Why ``rule`` (registered for a class in the module's MRO) does not describe ``module``."""
    t, base = type(module), rule.module_type
    for name, impl in zip(rule.methods, rule.impls):
        if _static(base, name) is not impl:
            return (
                f"{base.__name__}.{name} was replaced after dpzoo's rule for {base.__name__} was "
                "registered, so that rule does not apply"
            )
    for cls in t.__mro__:
        if cls is base:
            break
        for name in rule.methods:
            if name in cls.__dict__ and cls.__dict__[name] is not _static(base, name):
                return f"{cls.__name__} overrides the {name} of {base.__name__}, so that rule does not apply"
    own = getattr(module, "__dict__", {})
    for name in rule.methods:
        if name in own:
            v = own[name]
            # the class's own method bound to this very module (``m.forward = m.forward``) is harmless
            if getattr(v, "__self__", None) is module and getattr(v, "__func__", None) is _static(t, name):
                continue
            return (
                f"its {name} was replaced on the instance (an attribute of the module, not "
                f"{base.__name__}.{name}), so the rule for {base.__name__} does not apply; `del module.{name}` "
                "restores the class's method"
            )
    return None


def _guarded(fn: Callable, rule_ref: list) -> Callable:
    """``fn`` re-checking, each time it runs, that the module still computes what the rule assumes
    (a method replaced on the instance after the hooks were attached)."""

    @functools.wraps(fn)
    def run(module, activations, grad_output, params):
        why = _mismatch(module, rule_ref[0])
        if why:
            raise UnsupportedModuleError(
                f"{type(module).__name__}: {why}; its per-sample gradients cannot be computed by the rule "
                "(the module changed after the hooks were attached)."
            )
        return fn(module, activations, grad_output, params)

    return run


def register_rule(
    *module_types: type,
    params: Iterable[str] = ("weight", "bias"),
    activation_free: Iterable[str] = (),
    check: Callable[[nn.Module], str | None] | None = None,
    grad_from: Callable[[nn.Module], nn.Module] | None = None,
    methods: Iterable[str] = (),
    half_factors: bool = False,
):
    """Decorator: ``@register_rule(nn.Linear, activation_free={"bias"})``.

    ``check(module)`` returns why a particular module cannot be handled (e.g. an
    Embedding with ``max_norm``), or None; attaching hooks then raises with that reason.

    ``methods``: the methods, besides ``forward``, whose behaviour the rule relies on (e.g.
    ``_conv_forward``). A subclass or an instance overriding any of them does not get the rule.

    ``half_factors``: the rule only reshapes its inputs into factors (a Linear), so a layer that
    ran in bfloat16 / float16 can hand them over as they are; any sum it forms must be float32.
    """
    names = ("forward",) + tuple(m for m in methods if m != "forward")

    def deco(fn):
        for t in module_types:
            ref: list = []
            rule = Rule(
                _guarded(fn, ref),
                t,
                tuple(params),
                frozenset(activation_free),
                check,
                grad_from,
                names,
                tuple(_static(t, m) for m in names),
                half_factors,
            )
            ref.append(rule)
            RULES[t] = rule
        return fn

    return deco


def _nearest(module: nn.Module) -> Rule | None:
    for cls in type(module).__mro__:
        if cls in RULES:
            return RULES[cls]
        if cls is nn.Module:
            break
    return None


def find_rule(module: nn.Module) -> Rule | None:
    """The rule of the nearest registered class in the module's MRO, if neither the module's class
    nor the instance overrides a method that rule relies on (see the module docstring)."""
    rule = _nearest(module)
    if rule is None or _mismatch(module, rule) is not None:
        return None
    return rule


def why_no_rule(module: nn.Module) -> str | None:
    """Why a module whose class derives from a registered one gets no rule (for error messages),
    or None (no registered class in its MRO, or the rule applies)."""
    rule = _nearest(module)
    return None if rule is None else _mismatch(module, rule)
