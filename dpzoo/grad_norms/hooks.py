"""``attach_norm_hooks``: per-sample gradient norms and clipped sums for every trainable
parameter of a model, in one backward pass.

How it works (BK paper, Algorithm 1):

1. forward: a hook on each layer with a trainable weight keeps the layer's input (the
   activation) and hooks its output tensor; layers whose only trainable parameters are
   biases get a backward hook and store nothing (DP-BiTFiT Algorithm 1, App. B);
2. backward: each hooked output's gradient is book-kept. ``hooks.backward(loss)`` asks
   autograd only for these output gradients (ghost differentiation), so no weight gradient
   is computed; ``loss.backward()`` works too;
3. the layer rules (``dpzoo.grad_norms.rules``) turn (activation, output gradient) into
   exact per-sample gradient representations, whose norms (ghost or instantiated, by the BK
   rule) and clipped sums Σ_i C_i g_i are computed on request.

Parameters used several times (tied embeddings, modules called twice) get exact norms from
all cross terms (:mod:`dpzoo.grad_norms.reps`, Phantom Clipping). Trainable "loose"
tensors a module owns directly (ViT ``cls_token``, ``pos_embed``) with a leading dimension
of 1 are swapped, for the module's forward, for per-sample copies whose gradients are the
per-sample gradients, if the owner's type is declared in :data:`LOOSE_TENSORS`
(:func:`register_loose_tensors`). Anything else raises :class:`~dpzoo.UnsupportedModuleError`,
and so does, each step, a use of a trainable parameter dpzoo did not record (counted in the
autograd graph).

Privacy unit: one sample = one row of the batch (batch-first); for sequence models the
whole sequence. Losses must be per-sample losses *summed* (``reduction="sum"``); with a
mean, every per-sample gradient is divided by B.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..errors import UnsupportedModuleError
from . import reps as R
from .registry import Rule, find_rule

__all__ = ["attach_norm_hooks", "NormHooks", "MODES", "output_tensors"]

MODES = ("auto", "ghost", "instantiate")


# Owners of loose tensors (trainable tensors used directly in the owner's forward, each
# broadcast over the batch from a leading dimension of 1). Only these are swapped for
# per-sample copies: the swap is exact only if the code expands the tensor over the batch
# (``cls_token.expand(B, -1, -1)``, ``x + pos_embed``), which dpzoo cannot check.
LOOSE_TENSORS: dict[type, tuple[str, ...]] = {}


LOOSE_CHECKS: dict[type, Callable[[nn.Module], "str | None"]] = {}


def register_loose_tensors(module_type: type, names: Iterable[str],
                           check: Callable[[nn.Module], "str | None"] | None = None) -> None:
    """Declare that ``module_type`` uses its tensors ``names`` (shape (1, ...), dim ≥ 2) only
    broadcast over the batch, so dpzoo may give each sample its own copy during forward.
    ``check(module)`` returns why a particular instance does not (it is then refused), or None."""
    LOOSE_TENSORS[module_type] = tuple(names)
    if check is not None:
        LOOSE_CHECKS[module_type] = check


def _timm_vit_check(module: nn.Module) -> str | None:
    if getattr(module, "dynamic_img_size", False):
        return ("dynamic_img_size=True resamples pos_embed as a (1, ...) tensor, which per-sample copies "
                "cannot follow; build the ViT with dynamic_img_size=False (a fixed image size)")
    return None


try:  # timm's Vision Transformers: cls_token, pos_embed, reg_token, broadcast in _pos_embed
    from timm.models.vision_transformer import VisionTransformer as _TimmViT
    register_loose_tensors(_TimmViT, ("cls_token", "pos_embed", "reg_token"), check=_timm_vit_check)
except ImportError:  # pragma: no cover
    pass

# Embeddings whose owner looks them up with ids of batch 1 (position ids) and adds the result
# to a (B, ...) tensor, i.e. broadcasts it over the batch: dpzoo gives every sample its own
# lookup (exact). Declared per owner: elsewhere a (1, ...) lookup may mean anything (T5's
# (Q, K) relative-position ids with Q = 1, `emb(ids[None])[0]`) and is refused by the batch
# check instead. Keys: (module path, class name) so transformers is never imported for it.
BROADCAST_LOOKUPS: dict[tuple[str, str], tuple[str, ...]] = {
    ("transformers.models.gpt2.modeling_gpt2", "GPT2Model"): ("wpe",),
    ("transformers.models.bert.modeling_bert", "BertEmbeddings"): ("position_embeddings",),
    ("transformers.models.roberta.modeling_roberta", "RobertaEmbeddings"): ("position_embeddings",),
    ("transformers.models.distilbert.modeling_distilbert", "Embeddings"): ("position_embeddings",),
    ("transformers.models.albert.modeling_albert", "AlbertEmbeddings"): ("position_embeddings",),
    ("transformers.models.clip.modeling_clip", "CLIPTextEmbeddings"): ("position_embedding",),
    ("transformers.models.gpt_neo.modeling_gpt_neo", "GPTNeoModel"): ("wpe",),
}


def register_broadcast_lookup(owner_type: type, names: Iterable[str]) -> None:
    """Declare that ``owner_type`` looks its Embeddings ``names`` up with batch-1 ids and only
    broadcasts the result over the batch (so each sample may get its own lookup)."""
    BROADCAST_LOOKUPS[(owner_type.__module__, owner_type.__qualname__)] = tuple(names)


def _broadcast_lookup(owner: nn.Module | None, attr: str) -> bool:
    if owner is None:
        return False
    for cls in type(owner).__mro__:
        if attr in BROADCAST_LOOKUPS.get((cls.__module__, cls.__qualname__), ()):
            return True
    return False
try:  # timm's attention pooling (global_pool="map"): latent.expand(B, -1, -1)
    from timm.layers.attention_pool import AttentionPoolLatent as _TimmAttnPool
    register_loose_tensors(_TimmAttnPool, ("latent",))
except ImportError:  # pragma: no cover
    pass


def _loose_names(module: nn.Module) -> tuple[str, ...]:
    for cls in type(module).__mro__:
        if cls in LOOSE_TENSORS:
            check = LOOSE_CHECKS.get(cls)
            why = check(module) if check is not None else None
            if why:
                raise UnsupportedModuleError(f"{type(module).__name__}: {why}.")
            return LOOSE_TENSORS[cls]
    return ()


@dataclass
class _Use:
    """One call of a hooked module (or one swap of a loose tensor) in the current step."""

    module: nn.Module
    module_name: str
    params: tuple[str, ...]  # local names of the trainable parameters it covers
    activations: tuple | None = None
    versions: tuple | None = None
    output: torch.Tensor | None = None
    edge: object | None = None  # autograd GradientEdge of the output, taken before any in-place op
    grad: torch.Tensor | None = None
    loose: bool = False
    batch_size: int | None = None
    task: int | None = None  # activation-free uses: the backward pass (graph task) that recorded it


@dataclass
class _ModulePlan:
    name: str
    module: nn.Module
    rule: Rule | None
    params: tuple[str, ...]  # trainable local parameter names this module owns
    needs_activations: bool
    loose: tuple[str, ...] = ()
    tensors: tuple = ()  # the parameter objects (a swap during forward, e.g. functional_call, is refused)
    broadcast_lookup: bool = False  # an Embedding its owner looks up with batch-1 ids (BROADCAST_LOOKUPS)


@dataclass
class _State:
    uses: list[_Use] = field(default_factory=list)
    backward_done: bool = False
    reps: dict | None = None
    sq_norms: dict | None = None
    batch_size: int | None = None  # from the root module's input
    root_ran: bool = False
    outputs: list = field(default_factory=list)  # the model's output tensors (for the use check)
    edges: dict | None = None  # parameter id -> direct uses in the graph (counted before backward)
    walked: set | None = None  # ids of the graph nodes reachable from the loss
    graph_checked: bool = False
    stray: list = field(default_factory=list)  # ghost_backward: parameters that got a weight gradient
    unreached: list = field(default_factory=list)  # parameters no gradient reached this step (zeros)
    calls: list = field(default_factory=list)  # per root forward call: its output tensors (real ones)
    cotangents: dict = field(default_factory=dict)  # id(real output) -> its gradient (ghost_backward)


def output_tensors(output) -> list[torch.Tensor]:
    """The tensors in a model's output that have a gradient path (inside tensors, tuples, lists,
    dicts and transformers' ModelOutputs), in a fixed order: two calls on outputs of the same
    structure list corresponding tensors at the same positions."""
    found, stack = [], [output]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            if o.grad_fn is not None:
                found.append(o)
        elif isinstance(o, dict):
            stack.extend(reversed(list(o.values())))
        elif isinstance(o, (list, tuple)):
            stack.extend(reversed(o))
    return found


def _first_tensor(args) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    return None


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _GhostBackward(torch.autograd.Function):
    """Identity on the model's outputs whose backward differentiates only to the hooked layers.

    The outputs handed to the user are cut from the model graph (their only input is a
    fresh leaf, ``anchor``); their backward runs ``autograd.grad`` from the real outputs to
    the hooked layers' outputs (ghost differentiation), so ``loss.backward()`` computes no
    weight gradient and leaves ``.grad`` alone.
    """

    @staticmethod
    def forward(ctx, hooks, real_outputs, anchor):
        ctx.hooks, ctx.real_outputs = hooks, real_outputs
        # Detached aliases of tensors that are not inputs of this Function: not views in
        # autograd's sense, so the user may edit them in place (e.g. mask logits); they share
        # the real outputs' version counters, so torch still refuses an in-place edit of an
        # output the model's graph saved, exactly as without hooks.
        return tuple(o.detach() for o in real_outputs)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.real_outputs is None:  # the model's graph was freed by the first pass
            raise UnsupportedModuleError(
                "With ghost_backward=True the model's outputs can be back-propagated once per forward pass "
                "(the model's graph is freed then, even with retain_graph=True): add the losses and call "
                "backward once.")
        outs = [(o, g) for o, g in zip(ctx.real_outputs, grads) if g is not None]
        for o, g in outs:  # kept for the engine's first-step self-check (dpzoo.privacy.verify)
            ctx.hooks._state.cotangents[id(o)] = g.detach()
        if outs:
            ctx.hooks._ghost_differentiate([o for o, _ in outs], [g for _, g in outs])
        ctx.real_outputs = None
        return None, None, None


class NormHooks:
    """Handle returned by :func:`attach_norm_hooks`. See the module docstring."""

    def __init__(self, model: nn.Module, mode: str = "auto", ghost_backward: bool = False):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        prev = getattr(model, "_dpzoo_norm_hooks", None)
        if prev is not None and prev() is not None and prev()._handles:
            raise UnsupportedModuleError("This model already has dpzoo norm hooks attached; call "
                                         ".detach() on the old handle first (two sets would split the records).")
        self.model, self.mode = model, mode
        self.ghost_backward = ghost_backward
        self._state = _State()
        self._handles: list = []
        self._plans: list[_ModulePlan] = []
        self._rules: dict[int, Rule] = {}  # id(module) -> its rule, looked up once at attach
        self._pending: dict[int, list] = {}
        self._by_edges = False
        self._pass, self._n_passes = None, 0  # the backward pass ghost differentiation runs for
        self._paused = False  # see paused(): reference passes of the self-check record nothing
        self._build_plan()
        self._register()
        model._dpzoo_norm_hooks = weakref.ref(self)

    # -- planning -------------------------------------------------------------------------
    def _build_plan(self) -> None:
        names: dict[int, list[str]] = {}
        for full, p in self.model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(full)
        self._param_names = {pid: ns[0] for pid, ns in names.items()}  # canonical names
        self._params = {self._param_names[id(p)]: p for p in self.model.parameters() if p.requires_grad}
        if not self._params:
            raise UnsupportedModuleError("The model has no trainable parameters (requires_grad=False everywhere).")
        inplace = [n or "<root>" for n, m in self.model.named_modules()
                   if isinstance(getattr(m, "inplace", None), bool) and m.inplace]
        if inplace:
            raise UnsupportedModuleError(
                f"Module(s) {', '.join(inplace[:8])} run in place (inplace=True), which corrupts the "
                "activations and output gradients dpzoo records. dpzoo.make_dp_ready(model) switches "
                "them off.")
        # BatchNorm without trainable parameters is in no plan, yet mixes samples whenever it
        # uses batch statistics: checked at every forward (train/eval can change after attach)
        self._batchnorms = [(n or "<root>", m) for n, m in self.model.named_modules() if isinstance(m, _BatchNorm)]
        seen: set[int] = set()
        for mname, module in self.model.named_modules():
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
                        f"{qualified} cannot be clipped per sample.")
                extra = [n for n in own if n not in rule.params]
                if extra:
                    raise UnsupportedModuleError(
                        f"Module {label} ({type(module).__name__}) has trainable parameter(s) "
                        f"{', '.join(extra)} that its per-sample rule does not cover. Freeze them "
                        "(requires_grad_(False)) or register a rule with dpzoo.grad_norms.register_rule.")
                needs = any(n not in rule.activation_free for n in own)
                owner_name, _, attr = mname.rpartition(".")
                owner = self.model.get_submodule(owner_name) if mname else None
                self._plans.append(_ModulePlan(mname, module, rule, own, needs,
                                               tensors=tuple(module._parameters[n] for n in own),
                                               broadcast_lookup=_broadcast_lookup(owner, attr)))
                self._rules[id(module)] = rule
                continue
            allowed = _loose_names(module)
            bad = [n for n in own if n not in allowed or getattr(module, n).dim() < 2
                   or getattr(module, n).shape[0] != 1]
            if bad:
                from .registry import why_no_rule
                why_not = why_no_rule(module)
                hint = f" ({why_not})" if why_not else ""
                raise UnsupportedModuleError(
                    f"Module {label} ({type(module).__name__}) has no per-sample-gradient rule for its "
                    f"trainable parameter(s) {', '.join(f'{mname}.{n}' if mname else n for n in bad)}{hint}. "
                    "dpzoo will not leave them unclipped: freeze them (requires_grad_(False)), "
                    "replace the layer, or register a rule with dpzoo.grad_norms.register_rule "
                    "(tensors broadcast over the batch: dpzoo.grad_norms.register_loose_tensors).")
            self._plans.append(_ModulePlan(mname, module, None, own, True, loose=own))

    # -- hooks ----------------------------------------------------------------------------
    def _register(self) -> None:
        # Root hooks for every model (bias-only ones too): the batch size, and the outputs
        # from which parameter uses are counted when loss.backward() is used.
        self._handles.append(self.model.register_forward_pre_hook(self._root_pre_hook, with_kwargs=True))
        self._bw_modules = []
        for plan in self._plans:
            m = plan.module
            if plan.loose:
                self._handles.append(m.register_forward_pre_hook(self._loose_pre_hook(plan)))
                self._handles.append(m.register_forward_hook(self._loose_post_hook(plan), always_call=True))
            elif plan.needs_activations:
                self._handles.append(m.register_forward_pre_hook(self._version_hook, with_kwargs=True))
                # first among the layer's forward hooks: it must see the layer's own output, before
                # any user hook edits it (the edit is then part of the graph behind it)
                self._handles.append(m.register_forward_hook(self._forward_hook(plan), with_kwargs=True,
                                                             prepend=True))
            else:  # activation-free: no forward hook on the layer, nothing stored (the root's
                # pre-hook marks a new step, so several backward passes in one step add up)
                if plan.rule.grad_from is not None:  # the gradient at a submodule's input
                    target = plan.rule.grad_from(m)
                    self._handles.append(target.register_full_backward_hook(
                        self._backward_hook(plan, use_grad_input=True)))
                else:  # the output gradient: a pre-hook needs no wrapping of the inputs (cheaper)
                    target = m
                    pre = self._backward_hook(plan)
                    self._handles.append(m.register_full_backward_pre_hook(lambda mod, go, f=pre: f(mod, None, go)))
                self._bw_modules.append(target)
        # The root's output hook last: when the root is itself a hooked layer (a bare nn.Linear),
        # the layer's hook must see the real output, not the one wrapped for ghost differentiation.
        self._handles.append(self.model.register_forward_hook(self._root_post_hook))
        if self.ghost_backward:
            # Ghost differentiation computes no parameter gradient (bias-only parameters only
            # inside it): one reaching a parameter comes from a use dpzoo cannot see (e.g. in
            # the loss, whose graph dpzoo does not walk on loss.backward()).
            for name, p in self._params.items():
                self._handles.append(p.register_hook(self._stray_grad_hook(name)))

    def _new_step_if_done(self) -> None:
        # Never inside a backward pass: activation checkpointing re-runs forwards there.
        if self._state.backward_done and not _in_backward():
            self._state = _State()

    def _stray_grad_hook(self, name: str):
        def hook(grad):
            if not self._by_edges and not self._paused:
                self._state.stray.append(name)
            return None
        return hook

    def _root_pre_hook(self, module, args, kwargs=None):
        # kwargs=None, no handles: a detached set still listed in a forward that re-planned
        # the hooks (torch calls the hooks it had listed when the forward started)
        if torch.is_grad_enabled() and not _in_backward() and not self._paused and self._handles:
            self._new_step_if_done()
            mixing = [n for n, m in self._batchnorms if m.training or m.running_mean is None]
            if mixing:
                raise UnsupportedModuleError(
                    f"BatchNorm module(s) {', '.join(mixing[:6])} use batch statistics: each sample's output depends "
                    "on the others, so no per-sample gradient exists. dpzoo.make_dp_ready(model) converts them to "
                    "GroupNorm; or put them in eval mode with running statistics.")
            x = _first_tensor(tuple(args) + tuple((kwargs or {}).values()))
            if x is not None and x.dim() > 0:
                self._state.batch_size = x.shape[0]
        return None

    def _root_post_hook(self, module, args, output):
        if not torch.is_grad_enabled() or _in_backward() or self._paused:
            return None
        self._state.root_ran = True
        found = output_tensors(output)
        self._state.outputs.extend(found)  # several forward passes may feed one loss
        self._state.calls.append(found)
        if self.ghost_backward and found:
            return self._wrap_outputs(output, found)
        return None

    def _wrap_outputs(self, output, found):
        anchor = torch.zeros((), requires_grad=True)
        wrapped = _GhostBackward.apply(self, tuple(found), anchor)
        mapping = {id(t): w for t, w in zip(found, wrapped)}

        def rebuild(o):
            if isinstance(o, torch.Tensor):
                return mapping.get(id(o), o)
            if isinstance(o, dict):  # dicts and transformers' ModelOutput
                for k in list(o.keys()):
                    o[k] = rebuild(o[k])
                return o
            if isinstance(o, tuple):
                items = [rebuild(x) for x in o]
                return type(o)(*items) if hasattr(o, "_fields") else tuple(items)
            if isinstance(o, list):
                return [rebuild(x) for x in o]
            return o
        return rebuild(output)

    def _version_hook(self, module, args, kwargs):
        if torch.is_grad_enabled() and not self._paused:
            ins = tuple(args) or tuple(v for v in kwargs.values() if isinstance(v, torch.Tensor))[:1]
            self._pending.setdefault(id(module), []).append(
                tuple(a._version if isinstance(a, torch.Tensor) else None for a in ins))
        return None

    def _forward_hook(self, plan: _ModulePlan):
        def hook(module, args, kwargs, output):
            if self._paused:
                return None
            pending = self._pending.get(id(module))
            versions = pending.pop() if pending else None
            if not torch.is_grad_enabled() or not isinstance(output, torch.Tensor) or not output.requires_grad:
                return None
            self._new_step_if_done()
            if not args:  # called as layer(input=x)
                args = tuple(v for v in kwargs.values() if isinstance(v, torch.Tensor))[:1]
            now = tuple(a._version if isinstance(a, torch.Tensor) else None for a in args)
            if versions is not None and now != versions:
                raise UnsupportedModuleError(
                    f"{plan.name} ({type(module).__name__}) modified its own input in place during forward; "
                    "its per-sample gradient cannot be computed from the stored input. Switch the "
                    "in-place option off (dpzoo.make_dp_ready does).")
            b = self._state.batch_size
            x = _first_tensor(args)
            if x is None or x.dim() == 0:
                raise UnsupportedModuleError(f"{plan.name} ({type(module).__name__}) got no batched tensor input.")
            if any(module._parameters.get(n) is not t for n, t in zip(plan.params, plan.tensors)):
                raise UnsupportedModuleError(
                    f"The parameters of {plan.name} ({type(module).__name__}) were swapped for other tensors during "
                    "this forward (torch.func.functional_call, a parametrization or stateless call): dpzoo's rule "
                    "would attribute the gradient to the wrong tensor. Call the model with its own parameters.")
            expanded = None
            if (plan.broadcast_lookup and b is not None and b > 1 and x.shape[0] == 1
                    and not x.is_floating_point() and output.shape[0] == 1):
                # Position ids of batch 1 broadcast over the batch (HF): give every sample
                # its own lookup, so the table's gradient splits per sample (exact).
                args = tuple(a.expand(b, *a.shape[1:]) if isinstance(a, torch.Tensor) else a for a in args)
                output = expanded = output.expand(b, *output.shape[1:])
                x = args[0]
            if b is not None and x.shape[0] != b:
                raise UnsupportedModuleError(
                    f"{plan.name} ({type(module).__name__}) got an input with {x.shape[0]} rows in its first "
                    f"dimension but the batch has {b} samples. Per-sample gradients need every hooked layer to "
                    "take batch-first inputs (no sequence-first, flattened or unbatched inputs).")
            acts = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
            use = _Use(module, plan.name, plan.params, acts, versions if versions is not None else now, output,
                       torch.autograd.graph.get_gradient_edge(output), batch_size=x.shape[0])
            output.register_hook(self._grad_catcher(use))
            self._state.uses.append(use)
            return expanded  # None (output unchanged) unless expanded
        return hook

    def _grad_catcher(self, use: _Use):
        # Weak references only: the hook lives on the output's autograd node, and a strong
        # reference back to the record (which holds that output) would form a cycle through
        # C++ that Python's garbage collector cannot see, leaking every step's activations.
        use_ref, self_ref = weakref.ref(use), weakref.ref(self)

        def catch(grad):
            hooks, u = self_ref(), use_ref()
            if hooks is None or u is None or hooks._by_edges:
                return  # step already dropped, or hooks.backward collects it from its edge
            u.grad = grad.detach() if u.grad is None else u.grad + grad.detach()
            hooks._state.backward_done = True
        return catch

    def _backward_hook(self, plan: _ModulePlan, use_grad_input: bool = False):
        def hook(module, grad_input, grad_output):
            grad = grad_input[0] if use_grad_input else grad_output[0]
            if grad is None or self._paused:
                return None
            # the backward pass: the user's, also when ghost differentiation runs inside it
            task = self._pass if self._by_edges else torch._C._current_graph_task_id()
            self._state.uses.append(_Use(plan.module, plan.name, plan.params, grad=grad.detach(),
                                         batch_size=grad.shape[0], task=task))
            self._state.backward_done = True
            return None
        return hook

    def _loose_pre_hook(self, plan: _ModulePlan):
        def hook(module, args, kwargs=None):
            x = _first_tensor(args)
            if x is None or not torch.is_grad_enabled() or _in_backward() or self._paused:
                return None
            self._new_step_if_done()
            b = x.shape[0]
            for n in plan.loose:
                p = getattr(module, n)
                # a per-sample copy, detached from p: any use of p itself is then visible
                copy = p.detach().expand(b, *p.shape[1:]).clone().requires_grad_(True)
                module.__dict__[n] = copy  # shadows the registered parameter during forward
                use = _Use(module, plan.name, (n,), output=copy, edge=torch.autograd.graph.get_gradient_edge(copy),
                           loose=True, batch_size=b)
                copy.register_hook(self._grad_catcher(use))
                self._state.uses.append(use)
            return None
        return hook

    def _loose_post_hook(self, plan: _ModulePlan):
        def hook(module, args, output):
            for n in plan.loose:
                module.__dict__.pop(n, None)
            return None
        return hook

    # -- backward ---------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate ``loss`` computing only what the per-sample norms need.

        Autograd computes the output gradients of hooked layers and the gradients of
        bias-only layers, but no weight gradient (BK's ghost differentiation); parameters'
        ``.grad`` are left as they were.
        """
        if self._state.backward_done:
            raise UnsupportedModuleError(
                "A backward pass already ran since the last forward (loss.backward() or hooks.backward()); "
                "hooks.backward(loss) would add this loss's per-sample gradients to it. Call hooks.backward "
                "once per forward pass, and not after loss.backward() (several loss.backward() calls in "
                "one step add up).")
        if self.ghost_backward and self._state.outputs:
            self._count_edges([loss])  # uses of parameters in the loss are checked too
            loss.backward()  # the outputs are wrapped: this is ghost differentiation already
            return
        self._ghost_differentiate([loss], None)

    def _ghost_differentiate(self, roots: list, grads: list | None) -> None:
        # Count the uses in the graph of these roots too: with ghost_backward, hooks.backward
        # counted only the loss's graph, and several forward passes each reach here once.
        self._count_edges(roots)
        uses = [u for u in self._state.uses if u.edge is not None and u.output is not None and u.output.requires_grad]
        targets = [u.edge for u in uses]
        n_edges = len(targets)
        for plan in self._plans:  # bias-only layers: their backward hooks fire on the way
            if not plan.needs_activations:
                targets += [getattr(plan.module, n) for n in plan.params if getattr(plan.module, n).requires_grad]
        if not targets:
            raise RuntimeError("No hooked layer took part in this forward pass; nothing to differentiate.")
        outer = torch._C._current_graph_task_id()  # the user's loss.backward() (ghost_backward), or none
        self._n_passes += 1
        self._pass = outer if outer != -1 else ("hooks.backward", self._n_passes)
        self._by_edges = True
        try:
            with warnings.catch_warnings():
                # torch warns when a hooked layer's inputs need no gradient (the first layer's
                # never do): expected here, since only output gradients are wanted
                warnings.filterwarnings("ignore", message="Full backward hook is firing")
                got = torch.autograd.grad(roots, targets, grads, allow_unused=True)
        finally:
            self._by_edges = False
        for use, g in zip(uses, got[:n_edges]):
            if g is not None:
                use.grad = g.detach() if use.grad is None else use.grad + g.detach()
        self._state.backward_done = True
        self._compare_uses()

    def _count_edges(self, roots: list) -> None:
        """Count the direct uses of every trainable parameter in the graph of ``roots`` (added to
        the counts of graphs walked before in this step; shared nodes are walked once)."""
        if roots and all(r.grad_fn is None for r in roots):
            raise RuntimeError("loss does not require grad: did the forward pass run under no_grad?")
        st = self._state
        edges: dict[int, int] = st.edges if st.edges is not None else {}
        walked: set = st.walked if st.walked is not None else set()
        stack = [r.grad_fn for r in roots]
        while stack:
            fn = stack.pop()
            if fn is None or id(fn) in walked:
                continue
            walked.add(id(fn))
            for nxt, _ in fn.next_functions:
                if nxt is None:
                    continue
                var = getattr(nxt, "variable", None)
                if var is not None:
                    edges[id(var)] = edges.get(id(var), 0) + 1
                else:
                    stack.append(nxt)
        self._state.edges, self._state.walked = edges, walked

    def _compare_uses(self) -> None:
        """Every direct use of a trainable parameter must be one dpzoo recorded."""
        st = self._state
        if st.edges is None:
            return
        recorded: dict[int, int] = {}
        per_task: dict[tuple, int] = {}  # activation-free uses: (parameter, backward pass) -> count
        for u in st.uses:
            if u.loose:
                continue
            if u.edge is not None and id(u.edge.node) not in st.walked:
                continue  # this call's output does not reach the loss
            for n in u.params:
                pid = id(getattr(u.module, n))
                if u.edge is None:  # one use per module call per backward pass
                    per_task[pid, u.task] = per_task.get((pid, u.task), 0) + 1
                else:
                    recorded[pid] = recorded.get(pid, 0) + 1
        calls: dict[int, int] = {}
        for (pid, _), k in per_task.items():  # several backward passes replay the same calls
            calls[pid] = max(calls.get(pid, 0), k)
        for pid, k in calls.items():
            recorded[pid] = recorded.get(pid, 0) + k
        for name, p in self._params.items():
            if st.edges.get(id(p), 0) > recorded.get(id(p), 0):
                raise UnsupportedModuleError(
                    f"Parameter {name} is used {st.edges[id(p)]} time(s) in this step but dpzoo recorded "
                    f"{recorded.get(id(p), 0)}: it is used outside the module that owns it (e.g. `x @ "
                    "module.weight` in another module's forward, or in the loss). Its per-sample gradient "
                    "cannot be accounted for; route every use through a module, or freeze it.")
        st.graph_checked = True

    # -- results ----------------------------------------------------------------------------
    def _collect(self) -> dict[str, list]:
        st = self._state
        if st.reps is not None:
            return st.reps
        if not st.backward_done:
            raise RuntimeError("No backward pass since the last forward: call hooks.backward(loss) "
                               "or loss.backward() first.")
        if st.stray:
            raise UnsupportedModuleError(
                f"Parameter(s) {', '.join(dict.fromkeys(st.stray))} received a gradient outside dpzoo's ghost "
                "differentiation: they are used outside the model's forward (e.g. a weight penalty or a tied "
                "projection in the loss), so their per-sample gradient cannot be accounted for. Compute "
                "every use inside the model (or use the optimizer's weight_decay), or freeze them.")
        if not st.graph_checked:
            if st.outputs:  # loss.backward() was used: check from the model's outputs
                self._count_edges(st.outputs)
                self._compare_uses()
            elif not st.root_ran:
                raise UnsupportedModuleError(
                    "Hooked layers ran, but not through the model itself (model.forward(...) or a submodule "
                    "was called): dpzoo cannot check every parameter use. Call model(...), or use "
                    "hooks.backward(loss).")
            else:
                raise UnsupportedModuleError(
                    "The model's output holds no tensor dpzoo can find (it looks inside tensors, tuples, "
                    "lists and dicts), so the parameter uses behind loss.backward() cannot be checked. "
                    "Use hooks.backward(loss), or return tensors in one of these containers.")
        by_param: dict[str, list] = {n: [] for n in self._params}
        sizes = set()
        for use in st.uses:
            if use.grad is None:
                continue  # output did not reach the loss
            if use.loose:
                n = use.params[0]
                name = self._param_names[id(use.module._parameters[n])]
                by_param[name].append(R.Dense(use.grad.unsqueeze(1)))
                sizes.add((use.module_name, use.grad.shape[0]))
                continue
            rule = self._rules[id(use.module)]
            if use.versions is not None:
                for a, v in zip(use.activations, use.versions):
                    if isinstance(a, torch.Tensor) and v is not None and a._version != v:
                        raise UnsupportedModuleError(
                            f"The input of {use.module_name} was modified in place after the layer used "
                            "it; its per-sample gradient would be wrong. Remove the in-place op "
                            "(dpzoo.make_dp_ready switches off the usual ones).")
            try:
                out = rule.fn(use.module, use.activations, use.grad, set(use.params))
            except RuntimeError as e:  # e.g. mixed dtypes under autocast: refuse, naming the layer
                raise UnsupportedModuleError(
                    f"The per-sample rule for {use.module_name} ({type(use.module).__name__}) failed on what the layer "
                    f"recorded ({str(e).splitlines()[0][:160]}). Mixed precision by autocast is not supported: "
                    "convert the model to one dtype instead.") from e
            use.activations = None  # the representations hold what is needed from here on
            for local, rep in out.items():
                p = getattr(use.module, local)
                if tuple(_rep_shape(rep)) != tuple(p.shape):
                    raise UnsupportedModuleError(
                        f"The rule for {use.module_name} ({type(use.module).__name__}) produced a per-sample "
                        f"gradient of shape {tuple(_rep_shape(rep))} for {local}, whose shape is {tuple(p.shape)}: "
                        "the module does not compute what its rule assumes.")
                by_param[self._param_names[id(p)]].append(rep)
                sizes.add((use.module_name, rep.batch_size))
        batch = {b for _, b in sizes}
        if st.batch_size is not None:
            batch.add(st.batch_size)
        if len(batch) > 1:
            detail = ", ".join(sorted(f"{n or '<root>'}: {b}" for n, b in sizes))
            raise UnsupportedModuleError(
                f"Layers saw different batch sizes in one step (batch {st.batch_size}; {detail}), so "
                "per-sample gradients cannot be matched across them. Every hooked layer must take "
                "batch-first inputs.")
        st.unreached = [n for n, rs in by_param.items() if not rs]
        for n in st.unreached:  # unused in this step: zero gradient
            p = self._params[n]
            b = next(iter(batch)) if batch else 0
            by_param[n] = [R.Dense(torch.zeros(b, *p.shape, dtype=p.dtype, device=p.device))]
        st.reps = by_param
        return by_param

    @staticmethod
    def _batch_size(by_param) -> int:
        for rs in by_param.values():
            if rs:
                return rs[0].batch_size
        raise RuntimeError("No per-sample gradient was recorded in this step.")

    def _ghost_flag(self) -> bool | None:
        return {"auto": None, "ghost": True, "instantiate": False}[self.mode]

    def per_param_sq_norms(self) -> dict[str, torch.Tensor]:
        st = self._state
        if st.sq_norms is None:
            ghost = self._ghost_flag()
            reps = self._collect()
            out = {}
            for name, rs in reps.items():
                # BK-MixOpt (BK paper §3.2): a layer on the instantiation path has its per-sample
                # gradients formed once; the clipped sum reuses them and its factors (activations,
                # unfolded patches) are dropped here.
                rs = [R.Dense(R.instantiate(r)) if not isinstance(r, R.Dense)
                      and not (R.prefers_ghost(r) if ghost is None else ghost) else r for r in rs]
                if len(rs) > 2 and ghost is not True:
                    # Many uses (a recurrent cell called at every time step): summing the
                    # per-sample gradients costs O(uses) instead of O(uses²) cross terms.
                    dense = R.instantiate(rs[0])
                    for r in rs[1:]:
                        dense = dense + R.instantiate(r)
                    rs = [R.Dense(dense)]
                reps[name] = rs
                total = R.sq_norm(rs[0], ghost=ghost)
                for i in range(len(rs)):
                    if i:
                        total = total + R.sq_norm(rs[i], ghost=ghost)
                    for j in range(i + 1, len(rs)):  # cross terms of a parameter used twice
                        total = total + 2 * R.inner(rs[i], rs[j], ghost=ghost)
                out[name] = total.clamp_min(0)
            st.sq_norms = out
        return st.sq_norms

    def per_param_norms(self) -> dict[str, torch.Tensor]:
        """{parameter name: Tensor[B]} of ‖∂L_i/∂θ‖₂."""
        return {n: v.sqrt() for n, v in self.per_param_sq_norms().items()}

    def unreached_parameters(self) -> list[str]:
        """Trainable parameters no gradient reached in this step (their per-sample gradients are 0)."""
        self._collect()
        return list(self._state.unreached)

    def per_sample_norms(self) -> torch.Tensor:
        """Tensor[B]: ‖∂L_i/∂θ‖₂ over all trainable parameters θ (float32 or float64)."""
        sq = list(self.per_param_sq_norms().values())
        dtype = torch.float64 if any(s.dtype == torch.float64 for s in sq) else torch.float32
        return torch.stack([s.to(dtype) for s in sq]).sum(0).sqrt()

    def clipped_sum(self, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        """{parameter name: Σ_i scale[i] · ∂L_i/∂θ} (book-keeping: no second backward)."""
        reps = self._collect()
        b = self._batch_size(reps)
        if scale.dim() != 1 or scale.shape[0] != b:
            raise ValueError(f"scale must be a Tensor[{b}] (one factor per sample), got shape {tuple(scale.shape)}")
        out = {}
        for name, rs in reps.items():
            try:
                total = R.clipped_sum(rs[0], scale)
                for r in rs[1:]:
                    total = total + R.clipped_sum(r, scale)
            except RuntimeError as e:  # mixed dtypes (autocast) between activations and gradients
                raise UnsupportedModuleError(
                    f"The clipped sum of {name} failed on what its layer recorded ({str(e).splitlines()[0][:160]}). "
                    "Mixed precision by autocast is not supported: convert the model to one dtype instead.") from e
            out[name] = total.to(self._params[name].dtype)
        return out

    def per_sample_grads(self, row_sparse: bool = False) -> dict[str, "torch.Tensor | R.RowSparse"]:
        """{parameter name: Tensor[B, *shape]}: the per-sample gradients themselves, every use of
        a parameter summed (tied embeddings included). Memory B × parameters: use small physical
        batches. For what needs more than norms (DP-FROST's element-wise |g| and ℓ1 norms).

        ``row_sparse=True``: an embedding used only by lookups comes back as
        :class:`~dpzoo.grad_norms.reps.RowSparse` (the rows each sample touched), not B dense tables."""
        out = {}
        for name, rs in self._collect().items():
            if row_sparse and all(isinstance(r, R.OneHot) for r in rs):
                merged = rs[0] if len(rs) == 1 else R.OneHot(
                    torch.cat([r.index for r in rs], 1), torch.cat([r.right for r in rs], 1), rs[0].num_rows)
                out[name] = R.row_sparse(merged)
                continue
            total = R.instantiate(rs[0])
            for r in rs[1:]:
                total = total + R.instantiate(r)
            out[name] = total.to(self._params[name].dtype)
        return out

    @property
    def parameter_names(self) -> list[str]:
        return list(self._params)

    # -- the contract with DP engines (dpzoo.privacy) -----------------------------------------
    @property
    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        """{canonical name: parameter} of every parameter these hooks clip (trainable at attach)."""
        return dict(self._params)

    @property
    def step_ready(self) -> bool:
        """True once a backward pass ran since the last forward: the step's records are complete."""
        return self._state.backward_done

    @property
    def forward_calls(self) -> int:
        """Root forward passes recorded in the current step."""
        return len(self._state.calls)

    def output_cotangents(self, call: int = 0) -> list[torch.Tensor] | None:
        """The gradients that reached the outputs of root forward ``call`` in this step (with
        ``ghost_backward=True``), in :func:`output_tensors` order; zeros for an output the loss
        did not use; None if that call is unknown."""
        st = self._state
        if call >= len(st.calls):
            return None
        return [st.cotangents.get(id(o), torch.zeros_like(o)) for o in st.calls[call]]

    def backward_from(self, outputs: list[torch.Tensor], cotangents: list[torch.Tensor]) -> None:
        """Back-propagate given output gradients (a vector-Jacobian product) to the hooked layers,
        without weight gradients: ``hooks.backward`` for a loss given by its output gradients."""
        if self.ghost_backward:
            torch.autograd.backward(outputs, cotangents)  # the outputs are wrapped: ghost differentiation
        else:
            self._ghost_differentiate(list(outputs), list(cotangents))

    @contextlib.contextmanager
    def paused(self):
        """Forward and backward passes inside record nothing and are not wrapped: plain autograd
        on the model (the self-check's single-sample reference passes)."""
        was, self._paused = self._paused, True
        try:
            yield self
        finally:
            self._paused = was

    @property
    def batch_size(self) -> int:
        return self._batch_size(self._collect())

    def clear(self) -> None:
        """Drop the stored activations and gradients of the current step."""
        self._state = _State()
        self._pending.clear()

    def detach(self) -> None:
        """Remove every hook; the model is left as it was."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for m in getattr(self, "_bw_modules", []):
            if not m._backward_hooks:
                m._is_full_backward_hook = None
        for plan in self._plans:
            for n in plan.loose:
                plan.module.__dict__.pop(n, None)
        self.clear()
        if getattr(self.model, "_dpzoo_norm_hooks", None) is not None:
            self.model._dpzoo_norm_hooks = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.detach()

    def describe(self) -> list[str]:
        """One line per hooked module: its rule and whether it stores activations."""
        lines = []
        for p in self._plans:
            kind = "loose tensors" if p.loose else (p.rule.fn.__name__ if p.rule else "?")
            store = "activations" if p.needs_activations else "output gradient only"
            lines.append(f"{p.name or '<root>'}: {', '.join(p.params)} via {kind} ({store})")
        return lines


def _rep_shape(rep) -> tuple:
    return tuple(rep.grad.shape[1:]) if isinstance(rep, R.Dense) else tuple(rep.shape)


def attach_norm_hooks(model: nn.Module, mode: str = "auto", *, ghost_backward: bool = False) -> NormHooks:
    """Hook every trainable parameter of ``model`` for per-sample norms and clipped sums.

    ``mode``: ``"auto"`` chooses ghost norm or instantiation per layer by the BK rule
    (ghost iff 2T² < p·d); ``"ghost"`` / ``"instantiate"`` force one. Raises
    :class:`~dpzoo.UnsupportedModuleError` naming any trainable parameter it cannot cover.

    ``ghost_backward=True``: the model's outputs are returned through a node whose backward
    differentiates only to the hooked layers, so a plain ``loss.backward()`` is BK's ghost
    differentiation (no weight gradient, ``.grad`` untouched). dpzoo's engine uses this.
    """
    return NormHooks(model, mode, ghost_backward=ghost_backward)

