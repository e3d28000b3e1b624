"""Planning: which module of a model covers which trainable parameter, and how.

:func:`plan_model` walks the model once, at attach: every module owning trainable parameters
gets a :class:`ModulePlan` with its rule (:mod:`dpzoo.grad_norms.registry`), whether the rule
needs the layer's activations (or only its output gradient: DP-BiTFiT), and the loose tensors
swapped for per-sample copies (:mod:`dpzoo.grad_norms.rules.loose`). Anything no rule covers,
and modules that would corrupt the records (``inplace=True``), are refused here.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..errors import UnsupportedModuleError
from .registry import Rule, find_rule, why_no_rule
from .rules.loose import is_broadcast_lookup, loose_names

__all__ = ["ModulePlan", "ModelPlan", "plan_model"]


@dataclass
class ModulePlan:
    name: str
    module: nn.Module
    rule: Rule | None
    params: tuple[str, ...]  # trainable local parameter names this module owns
    needs_activations: bool
    loose: tuple[str, ...] = ()
    tensors: tuple = ()  # the parameter objects (a swap during forward, e.g. functional_call, is refused)
    broadcast_lookup: bool = False  # an Embedding its owner looks up with batch-1 ids (BROADCAST_LOOKUPS)


@dataclass
class ModelPlan:
    params: dict[str, nn.Parameter]  # canonical name -> trainable parameter
    param_names: dict[int, str]  # id(parameter) -> canonical name (every parameter)
    modules: list[ModulePlan]
    rules: dict[int, Rule]  # id(module) -> its rule, looked up once at attach
    batchnorms: list[tuple[str, nn.Module]]  # checked at every forward (train/eval can change)

    def describe(self) -> list[str]:
        """One line per hooked module: its rule and whether it stores activations."""
        lines = []
        for p in self.modules:
            kind = "loose tensors" if p.loose else (p.rule.fn.__name__ if p.rule else "?")
            store = "activations" if p.needs_activations else "output gradient only"
            lines.append(f"{p.name or '<root>'}: {', '.join(p.params)} via {kind} ({store})")
        return lines


def plan_model(model: nn.Module) -> ModelPlan:
    """Plan the hooks for every trainable parameter of ``model``, or raise
    :class:`~dpzoo.UnsupportedModuleError` naming what cannot be covered."""
    names: dict[int, list[str]] = {}
    for full, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(full)
    param_names = {pid: ns[0] for pid, ns in names.items()}  # canonical names
    params = {param_names[id(p)]: p for p in model.parameters() if p.requires_grad}
    if not params:
        raise UnsupportedModuleError("The model has no trainable parameters (requires_grad=False everywhere).")
    inplace = [
        n or "<root>" for n, m in model.named_modules() if isinstance(getattr(m, "inplace", None), bool) and m.inplace
    ]
    if inplace:
        raise UnsupportedModuleError(
            f"Module(s) {', '.join(inplace[:8])} run in place (inplace=True), which corrupts the "
            "activations and output gradients dpzoo records. dpzoo.make_dp_ready(model) switches "
            "them off."
        )
    # BatchNorm without trainable parameters is in no plan, yet mixes samples whenever it
    # uses batch statistics: checked at every forward (train/eval can change after attach)
    batchnorms = [(n or "<root>", m) for n, m in model.named_modules() if isinstance(m, _BatchNorm)]
    plans: list[ModulePlan] = []
    rules: dict[int, Rule] = {}
    seen: set[int] = set()
    for mname, module in model.named_modules():
        if id(module) in seen:
            continue
        seen.add(id(module))
        own = tuple(n for n, p in module.named_parameters(recurse=False) if p.requires_grad)
        if not own:
            continue
        rule = find_rule(module)
        label = mname or "<root>"
        qualified = ", ".join(f"{mname}.{n}" if mname else n for n in own)
        if rule is not None:
            why = rule.unsupported(module)
            if why:
                raise UnsupportedModuleError(
                    f"Module {label} ({type(module).__name__}): {why}; its trainable parameter(s) "
                    f"{qualified} cannot be clipped per sample."
                )
            extra = [n for n in own if n not in rule.params]
            if extra:
                raise UnsupportedModuleError(
                    f"Module {label} ({type(module).__name__}) has trainable parameter(s) "
                    f"{', '.join(extra)} that its per-sample rule does not cover. Freeze them "
                    "(requires_grad_(False)) or register a rule with dpzoo.grad_norms.register_rule."
                )
            needs = any(n not in rule.activation_free for n in own)
            owner_name, _, attr = mname.rpartition(".")
            owner = model.get_submodule(owner_name) if mname else None
            plans.append(
                ModulePlan(
                    mname,
                    module,
                    rule,
                    own,
                    needs,
                    tensors=tuple(module._parameters[n] for n in own),
                    broadcast_lookup=is_broadcast_lookup(owner, attr),
                )
            )
            rules[id(module)] = rule
            continue
        allowed = loose_names(module)
        bad = [n for n in own if n not in allowed or getattr(module, n).dim() < 2 or getattr(module, n).shape[0] != 1]
        if bad:
            why_not = why_no_rule(module)
            hint = f" ({why_not})" if why_not else ""
            raise UnsupportedModuleError(
                f"Module {label} ({type(module).__name__}) has no per-sample-gradient rule for its "
                f"trainable parameter(s) {', '.join(f'{mname}.{n}' if mname else n for n in bad)}{hint}. "
                "dpzoo will not leave them unclipped: freeze them (requires_grad_(False)), "
                "replace the layer, or register a rule with dpzoo.grad_norms.register_rule "
                "(tensors broadcast over the batch: dpzoo.grad_norms.register_loose_tensors)."
            )
        plans.append(ModulePlan(mname, module, None, own, True, loose=own))
    return ModelPlan(params, param_names, plans, rules, batchnorms)
