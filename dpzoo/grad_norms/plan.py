"""Planning: which module of a model covers which trainable parameter, and how; and every problem
that stops a model from DP training (:func:`find_problems`), the one list the hooks' refusals, the
engine's and ``dpzoo.check_dp_ready`` are all read from.

:func:`plan_model` walks the model once, at attach: every module owning trainable parameters
gets a :class:`ModulePlan` with its rule (:mod:`dpzoo.grad_norms.registry`), whether the rule
needs the layer's activations (or only its output gradient: DP-BiTFiT), and the loose tensors
swapped for per-sample copies (:mod:`dpzoo.grad_norms.rules.loose`). What that walk cannot cover
(no rule, a rule refusing the instance, parameters read by their owner without calling the module,
``inplace=True``, in-place residual blocks around GroupNormAct's bias) is a :class:`Problem` of stage
``"attach"``: ``plan_model`` raises on it. :func:`find_problems` adds what ``make_private`` refuses
before attaching (stage ``"setup"``: lazy parameters, Embedding ``max_norm``, layers mixing samples
in train mode) and what the hooks refuse at the first forward (``"forward"``: BatchNorm using batch
statistics in eval mode).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from ..errors import InvalidArgumentError, UnsupportedModuleError
from ..nn.hf_blocks import flattened_submodules
from .registry import Rule, find_rule, why_no_rule
from .rules.loose import functional_submodules, is_broadcast_lookup, loose_names, loose_refusal, shared_lookup_refusal

try:  # timm's ResNet blocks end with `x += shortcut` (dpzoo.surgery swaps them for out-of-place ones)
    from timm.models.resnet import BasicBlock, Bottleneck

    INPLACE_RESIDUAL_BLOCKS: tuple[type, ...] = (BasicBlock, Bottleneck)
except ImportError:  # pragma: no cover - timm is a dependency
    INPLACE_RESIDUAL_BLOCKS = ()

__all__ = [
    "ModulePlan",
    "ModelPlan",
    "Problem",
    "STAGES",
    "plan_model",
    "find_problems",
    "refusal",
    "INPLACE_RESIDUAL_BLOCKS",
]

STAGES = ("setup", "attach", "forward")

# Layers dpzoo.make_dp_ready replaces by a DP-ready equivalent (named in refusals)
_REPLACEMENTS: dict[type[nn.Module], str] = {
    nn.MultiheadAttention: "dpzoo.nn.DPMultiheadAttention",
    nn.LSTM: "dpzoo.nn.DPLSTM",
    nn.GRU: "dpzoo.nn.DPGRU",
    nn.RNN: "dpzoo.nn.DPRNN",
    _BatchNorm: "GroupNorm",
}


@dataclass(frozen=True)
class Problem:
    """One reason a model cannot be trained with DP as it is."""

    module: str  # the module's name ("<root>": the model itself)
    kind: str  # no-trainable, inplace, functional-use, rule-refuses, uncovered, loose-refused, no-rule,
    # inplace-residual, flattened-tokens, shared-lookup (attach); lazy, embedding-max-norm, sample-mixing (setup); batch-statistics (forward)
    message: str  # one line: what is wrong and how to fix it (the refusal's text)
    stage: str = "attach"  # setup: make_private refuses; attach: attach_norm_hooks too; forward: the first forward
    params: tuple[str, ...] = ()  # qualified names of the parameters concerned

    def __str__(self) -> str:
        return f"{self.module}: {self.message}"


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


def _replacement_hint(cls: type[nn.Module]) -> str:
    """The fix make_dp_ready applies to ``cls`` (exact classes; any BatchNorm), or ""."""
    for t, new in _REPLACEMENTS.items():
        if cls is t or (t is _BatchNorm and issubclass(cls, t)):
            return f" dpzoo.make_dp_ready(model) replaces it with {new}."
    return ""


def _module_problem(model, mname: str, module: nn.Module, own: tuple[str, ...], owner_of: dict):
    """(a ModulePlan, None) for a module with trainable parameters ``own``, or (None, its Problem)."""
    label = mname or "<root>"
    qualified = tuple(f"{mname}.{n}" if mname else n for n in own)
    shown = ", ".join(qualified)
    kind_name = type(module).__name__
    if id(module) in owner_of:
        owner, otype = owner_of[id(module)]
        return None, Problem(
            label,
            "functional-use",
            f"Module {label} ({kind_name}): its trainable parameter(s) {shown} are read directly by {owner} "
            f"({otype.__name__}), which never calls {label}, so no per-sample rule sees them. Freeze them "
            f"(requires_grad_(False)) or replace {owner}.{_replacement_hint(otype)}",
            params=qualified,
        )
    rule = find_rule(module)
    if rule is not None:
        why = rule.unsupported(module)
        if why:
            return None, Problem(
                label,
                "rule-refuses",
                f"Module {label} ({kind_name}): {why}; its trainable parameter(s) {shown} cannot be clipped per sample.",
                params=qualified,
            )
        extra = [n for n in own if n not in rule.params]
        if extra:
            return None, Problem(
                label,
                "uncovered",
                f"Module {label} ({kind_name}) has trainable parameter(s) {', '.join(extra)} that its per-sample "
                "rule does not cover. Freeze them (requires_grad_(False)) or register a rule with "
                "dpzoo.grad_norms.register_rule.",
                params=tuple(q for q, n in zip(qualified, own) if n in extra),
            )
        owner_name, _, attr = mname.rpartition(".")
        owner = model.get_submodule(owner_name) if mname else None
        shared = shared_lookup_refusal(owner, attr, f"{label} ({kind_name})", mname)
        if shared:
            return None, Problem(label, "shared-lookup", shared, params=qualified)
        needs = any(n not in rule.activation_free for n in own)
        tensors = tuple(module._parameters[n] for n in own)
        return ModulePlan(
            mname, module, rule, own, needs, tensors=tensors, broadcast_lookup=is_broadcast_lookup(owner, attr)
        ), None
    refused = loose_refusal(module)
    if refused:
        return None, Problem(label, "loose-refused", refused, params=qualified)
    allowed = loose_names(module)
    bad = [q for q, n in zip(qualified, own) if n not in allowed or _not_broadcast(getattr(module, n))]
    if bad:
        why_not = why_no_rule(module)
        hint = f" ({why_not})" if why_not else ""
        return None, Problem(
            label,
            "no-rule",
            f"Module {label} ({kind_name}) has no per-sample-gradient rule for its trainable parameter(s) "
            f"{', '.join(bad)}{hint}. dpzoo will not leave them unclipped: freeze them (requires_grad_(False)), "
            "replace the layer, or register a rule with dpzoo.grad_norms.register_rule (tensors broadcast over "
            f"the batch: dpzoo.grad_norms.register_loose_tensors).{_replacement_hint(type(module))}",
            params=tuple(bad),
        )
    return ModulePlan(mname, module, None, own, True, loose=own), None


def _not_broadcast(p) -> bool:
    return p.dim() < 2 or p.shape[0] != 1


def _survey(model: nn.Module) -> tuple[ModelPlan, list[Problem]]:
    """The plan of every module the hooks can cover, and the attach-stage problems of the rest."""
    problems: list[Problem] = []
    names: dict[int, list[str]] = {}
    for full, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(full)
    param_names = {pid: ns[0] for pid, ns in names.items()}  # canonical names
    params = {param_names[id(p)]: p for p in model.parameters() if p.requires_grad}
    if not params:
        msg = (
            "The model has no trainable parameters (requires_grad=False everywhere: all frozen, or a forward inside "
            "PEFT's `with model.disable_adapter():`, which freezes the adapters); run forward passes that train "
            "nothing under torch.no_grad()."
        )
        problems.append(Problem("<root>", "no-trainable", msg))
    for n, m in model.named_modules():
        if isinstance(getattr(m, "inplace", None), bool) and m.inplace:
            label = n or "<root>"
            problems.append(
                Problem(
                    label,
                    "inplace",
                    f"Module {label} ({type(m).__name__}) runs in place (inplace=True), which corrupts the "
                    "activations and output gradients dpzoo records. dpzoo.make_dp_ready(model) switches it off.",
                )
            )
    # BatchNorm without trainable parameters is in no plan, yet mixes samples whenever it
    # uses batch statistics: checked at every forward (train/eval can change after attach)
    batchnorms = [(n or "<root>", m) for n, m in model.named_modules() if isinstance(m, _BatchNorm)]
    owner_of = {}
    for n, m in model.named_modules():
        for sub in functional_submodules(m):
            child = getattr(m, sub, None)
            if isinstance(child, nn.Module):
                owner_of[id(child)] = (n or "<root>", type(m))
    plans: list[ModulePlan] = []
    seen: set[int] = set()
    for mname, module in model.named_modules():
        if id(module) in seen:
            continue
        seen.add(id(module))
        own = tuple(n for n, p in module.named_parameters(recurse=False) if p.requires_grad)
        if own:
            plan, problem = _module_problem(model, mname, module, own, owner_of)
            if plan is not None:
                plans.append(plan)
            if problem is not None:
                problems.append(problem)
    problems += _inplace_residuals(model, plans) + _flattening(model, plans)
    rules = {id(p.module): p.rule for p in plans if p.rule is not None}
    return ModelPlan(params, param_names, plans, rules, batchnorms), problems


def _inplace_residuals(model: nn.Module, plans: list[ModulePlan]) -> list[Problem]:
    """timm blocks adding their shortcut in place onto the output of a layer whose bias-only gradient
    is read by a torch full backward hook (rules with ``grad_from``: timm's GroupNormAct), which torch
    refuses. Bias-only layers read at their own output take such edits (refused for them too until
    2026-11-28, when they also used a full backward hook)."""
    out = []
    hooked = [p.name for p in plans if not p.needs_activations and not p.loose and p.rule.grad_from is not None]
    for n, m in model.named_modules():
        inside = [h for h in hooked if not n or h == n or h.startswith(n + ".")]
        if type(m) in INPLACE_RESIDUAL_BLOCKS and inside:
            label = n or "<root>"
            out.append(
                Problem(
                    label,
                    "inplace-residual",
                    f"Module {label} ({type(m).__name__}) adds its shortcut in place (x += shortcut) onto outputs of "
                    f"layers whose bias-only gradient dpzoo reads with a backward hook ({', '.join(inside[:4])}), "
                    "which torch refuses. dpzoo.make_dp_ready(model) swaps the block for an out-of-place one.",
                )
            )
    return out


def _flattening(model: nn.Module, plans: list[ModulePlan]) -> list[Problem]:
    """Blocks calling hooked layers on flattened (B·T, d) tokens (OPT's decoder layer): those layers
    never see the batch in dim 0, so which rows are which sample's is lost."""
    hooked = {p.name for p in plans}
    out = []
    for n, m in model.named_modules():
        inside = [f"{n}.{s}" if n else s for s in flattened_submodules(m)]
        inside = [q for q in inside if any(h == q or h.startswith(q + ".") for h in hooked)]
        if inside:
            label = n or "<root>"
            out.append(
                Problem(
                    label,
                    "flattened-tokens",
                    f"Module {label} ({type(m).__name__}) calls {', '.join(inside)} on its tokens flattened to "
                    "(batch · length, features), so no per-sample gradient can be told apart there. "
                    "dpzoo.make_dp_ready(model) swaps it for a batch-first equivalent (dpzoo.nn.DPOPTDecoderLayer).",
                )
            )
    return out


def _setup_problems(model: nn.Module) -> list[Problem]:
    """What ``make_private`` refuses before attaching: lazy parameters, LoRA adapters initialised
    from data (EVA, CorDA) unless declared public, Embeddings with max_norm, layers mixing samples
    or updating running statistics from the batch in train mode."""
    out = []
    for n, p in model.named_parameters():
        if isinstance(p, nn.parameter.UninitializedParameter):
            owner = n.rpartition(".")[0] or "<root>"
            out.append(
                Problem(
                    owner,
                    "lazy",
                    f"Parameter {n} is not initialised yet (lazy module): run one forward pass on a dummy "
                    "(non-private) batch first, so dpzoo can plan its per-sample gradients.",
                    "setup",
                    (n,),
                )
            )
    from ..integrations.peft_layers import data_driven_inits  # imports nothing of peft unless loaded

    for adapter, why in data_driven_inits(model).items():
        out.append(
            Problem(
                adapter,
                "data-driven-init",
                f"LoRA adapter {adapter!r} has a data-driven initialisation ({why}): computed on the private data, "
                "it releases a statistic of them outside ε. Initialise it without data (init_lora_weights=True), "
                "or, if the data were public, say so: dpzoo.integrations.peft.declare_public_init(model, "
                f"{adapter!r}, source='...').",
                "setup",
            )
        )
    for n, m in model.named_modules():
        label = n or "<root>"
        if isinstance(m, nn.Embedding) and m.max_norm is not None:
            out.append(
                Problem(
                    label,
                    "embedding-max-norm",
                    f"Embedding {label} has max_norm: forward renormalises the rows the batch looks up, in place, "
                    "which releases which ids the private batch holds. Set max_norm=None.",
                    "setup",
                )
            )
        tracked = isinstance(m, _InstanceNorm) and m.track_running_stats
        if m.training and (isinstance(m, _BatchNorm) or tracked):
            if tracked:
                what, fix = "its running statistics", "Build it with track_running_stats=False"
            else:
                what, fix = "its outputs and running statistics", "Convert it with dpzoo.make_dp_ready(model)"
            out.append(
                Problem(
                    label,
                    "sample-mixing",
                    f"{type(m).__name__} {label} would mix samples in train mode: {what} depend on the whole batch "
                    f"(updated without noise). {fix}, or put it in eval mode and freeze it.",
                    "setup",
                )
            )
    return out


def _forward_problems(model: nn.Module) -> list[Problem]:
    """What the hooks refuse at the first forward: BatchNorm in eval mode without running statistics."""
    return [
        Problem(
            n or "<root>",
            "batch-statistics",
            f"{type(m).__name__} {n or '<root>'} has no running statistics (track_running_stats=False), so it "
            "normalises with the batch's even in eval mode: each sample's output depends on the others. "
            "dpzoo.make_dp_ready(model) converts it to GroupNorm.",
            "forward",
        )
        for n, m in model.named_modules()
        if isinstance(m, _BatchNorm) and not m.training and m.running_mean is None
    ]


def find_problems(model: nn.Module, stages: tuple[str, ...] = STAGES) -> list[Problem]:
    """Every :class:`Problem` that stops ``model`` from DP training as it is (its current
    ``requires_grad`` flags and train/eval modes), in the order the checks meet them: ``"setup"``
    (``make_private`` refuses), ``"attach"`` (``attach_norm_hooks`` refuses), ``"forward"`` (the hooks
    refuse the first forward). [] means dpzoo's engine accepts the model."""
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise InvalidArgumentError(f"stages must be among {STAGES}, got {', '.join(map(repr, unknown))}.")
    out = _setup_problems(model) if "setup" in stages else []
    if "attach" in stages:
        out += _survey(model)[1]
    if "forward" in stages:
        out += _forward_problems(model)
    return out


def refusal(problems: list[Problem]) -> str:
    """The one-line error for ``problems`` (non-empty): the first, or every in-place module at once."""
    first = problems[0]
    if first.kind == "inplace":
        names = [p.module for p in problems if p.kind == "inplace"]
        msg = (
            f"Module(s) {', '.join(names[:8])} run in place (inplace=True), which corrupts the activations and "
            "output gradients dpzoo records. dpzoo.make_dp_ready(model) switches them off."
        )
        rest = len(problems) - len(names)
    else:
        msg, rest = first.message, len(problems) - 1
    return msg + (f" ({rest} more problem(s): dpzoo.check_dp_ready(model) lists them all.)" if rest > 0 else "")


def plan_model(model: nn.Module) -> ModelPlan:
    """Plan the hooks for every trainable parameter of ``model``, or raise
    :class:`~dpzoo.UnsupportedModuleError` naming what cannot be covered (its attach-stage problems)."""
    plan, problems = _survey(model)
    if problems:
        raise UnsupportedModuleError(refusal(problems))
    return plan
