"""Capture: the hooks that record one step (forward hooks, and gradient hooks on layer outputs).

A :class:`Recorder` holds what a set of hooks records in the current step (a :class:`Step`:
one :class:`Use` per call of a hooked module or swap of a loose tensor, the model's outputs,
the graph audit's counts) and the runtime flags shared with ghost differentiation
(:mod:`dpzoo.grad_norms.ghost`). :class:`Capture` registers, from a
:class:`~dpzoo.grad_norms.plan.ModelPlan`:

* on the root: the batch size and BatchNorm check before forward, the output tensors after it
  (wrapped for ghost differentiation with ``ghost_backward``);
* on each layer whose rule needs activations: its input (detached, with version counters) and
  a gradient catcher on its output;
* on activation-free layers (DP-BiTFiT): a hook on the layer's own output storing its gradient only
  (a backward hook on the module's input gradient for rules with ``grad_from``);
* on owners of loose tensors: per-sample copies swapped in for the module's forward;
* under FSDP2, the unsharded tensors that stand in for sharded parameters during a pass
  (:mod:`dpzoo.grad_norms.sharded`), noted so the audit and ghost differentiation see them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..errors import UnsupportedModuleError
from . import tensors
from .copy_inert import CopyInert
from .plan import ModelPlan, ModulePlan
from .sharded import is_dtensor, note_alias, stands_in
from .tensors import first_tensor, gradient_source, in_backward, output_tensors

__all__ = ["Use", "Step", "Recorder", "Capture", "output_tensors", "first_tensor", "in_backward"]

SWAPPED = ("The parameters of {name} ({kind}) were swapped for other tensors during this forward (torch.func.functional_"
           "call, a parametrization or stateless call): dpzoo's rule would attribute the gradient to the wrong tensor. "
           "Call the model with its own parameters.")  # fmt: skip


@dataclass
class Use:
    """One call of a hooked module (or one swap of a loose tensor) in the current step."""

    module: nn.Module
    module_name: str
    params: tuple[str, ...]  # local names of the trainable parameters it covers
    activations: tuple | None = None
    versions: tuple | None = None
    output: torch.Tensor | None = None
    edge: object | None = None  # autograd GradientEdge of the output, taken before any in-place op
    view_of: tuple | None = None  # the edge is the output's base: its gradient, read as the output (tensors.as_output)
    grad: torch.Tensor | None = None
    loose: bool = False
    batch_size: int | None = None
    task: int | None = None  # activation-free uses: the backward pass (graph task) that recorded it


@dataclass
class Step:
    """Everything recorded in one step (from the first forward after a backward to the next)."""

    uses: list[Use] = field(default_factory=list)
    backward_done: bool = False
    grads: dict | None = None  # parameter name -> param_grad.ParamGrad, once assembled
    sq_norms: dict | None = None
    batch_size: int | None = None  # from the root module's input
    root_ran: bool = False
    outputs: list = field(default_factory=list)  # the model's output tensors (for the use check)
    edges: dict | None = None  # parameter id -> direct uses in the graph (counted before backward)
    walked: dict | None = None  # id -> graph node reachable from the loss (held, so ids stay unique)
    graph_checked: bool = False
    reentrant_checkpoint: bool = False  # a reentrant checkpoint's node was walked (audit.count_edges)
    stray: list = field(default_factory=list)  # ghost_backward: parameters that got a weight gradient
    unreached: list = field(default_factory=list)  # parameters no gradient reached this step (zeros)
    costs: dict = field(default_factory=dict)  # the planner's choice per use of each parameter (cost.UseCost)
    calls: list = field(default_factory=list)  # per root forward call: its output tensors (real ones)
    cotangents: dict = field(default_factory=dict)  # id(real output) -> its gradient (ghost_backward)
    aliases: dict = field(default_factory=dict)  # id(stand-in) -> (stand-in, planned parameter): FSDP2
    groups: Any = None  # units.UnitLayout: rows clipped together as one privacy unit (a user's examples)


class Recorder:
    """The mutable runtime of one set of hooks: the current :class:`Step` and the flags the
    capture hooks, ghost differentiation and the graph audit share."""

    def __init__(self):
        self.step = Step()
        self.paused = False  # reference passes of the self-check record nothing
        self.by_edges = False  # ghost differentiation is running: it collects output gradients itself
        self.pass_id = None  # the backward pass ghost differentiation runs for
        self.n_passes = 0
        self.pending: dict[int, list] = {}  # id(module) -> input versions taken before its forward
        self.handles: list = []  # every hook handle; empty once detached

    def new_step_if_done(self) -> None:
        # Never inside a backward pass: activation checkpointing re-runs forwards there.
        if self.step.backward_done and not in_backward():
            self.step = Step()

    def clear(self) -> None:
        self.step = Step()
        self.pending.clear()


class Capture:
    """Registers the recording hooks of ``plan`` on ``model``, recording into ``rec``.
    ``wrap(output, found)``: applied to the root's output (ghost differentiation), or None."""

    def __init__(
        self,
        model: nn.Module,
        plan: ModelPlan,
        rec: Recorder,
        wrap: Callable | None = None,
        on_alias: Callable | None = None,
    ):
        self.model, self.plan, self.rec, self.wrap = model, plan, rec, wrap
        self.bw_modules: list[nn.Module] = []
        self.first_hooks: dict[int, int] = {}  # id(layer) -> the handle id of dpzoo's forward hook on it
        self.on_alias = on_alias  # (planned parameter, its stand-in) the first time one is seen
        self.seen_aliases: set[int] = set()

    def register(self, root_pre_hook: Callable | None = None) -> None:
        """Register every hook; ``root_pre_hook`` (default :meth:`begin_forward`) replaces the
        root's forward pre-hook (it must call :meth:`begin_forward`)."""
        handles = self.rec.handles
        # Root hooks for every model (bias-only ones too): the batch size, and the outputs
        # from which parameter uses are counted when loss.backward() is used.
        handles.append(
            self.model.register_forward_pre_hook(CopyInert(root_pre_hook or self.begin_forward), with_kwargs=True)
        )
        for plan in self.plan.modules:
            m = plan.module
            if plan.loose:
                handles.append(m.register_forward_pre_hook(CopyInert(self._loose_pre_hook(plan))))
                handles.append(m.register_forward_hook(CopyInert(self._loose_post_hook(plan)), always_call=True))
            elif plan.needs_activations:
                handles.append(m.register_forward_pre_hook(CopyInert(self._version_hook), with_kwargs=True))
                # first among the layer's forward hooks: it must see the layer's own output, before
                # any user hook edits it (the edit is then part of the graph behind it)
                handles.append(
                    m.register_forward_hook(CopyInert(self._forward_hook(plan)), with_kwargs=True, prepend=True)
                )
                self.first_hooks[id(m)] = handles[-1].id
            else:  # activation-free: nothing stored (several backward passes in one step add up)
                if plan.rule.grad_from is not None:  # the gradient at a submodule's input
                    target = plan.rule.grad_from(m)
                    handles.append(target.register_full_backward_hook(CopyInert(self._backward_hook(plan))))
                    self.bw_modules.append(target)
                else:  # the output gradient: a hook on the layer's own output, first among its forward hooks
                    hook = CopyInert(self._output_grad_hook(plan))
                    handles.append(m.register_forward_hook(hook, with_kwargs=True, prepend=True))
                    self.first_hooks[id(m)] = handles[-1].id
                if any(is_dtensor(t) for t in plan.tensors):  # FSDP2: note the unsharded stand-ins
                    handles.append(m.register_forward_pre_hook(CopyInert(self._alias_pre_hook(plan))))
        # The root's output hook last: when the root is itself a hooked layer (a bare nn.Linear),
        # the layer's hook must see the real output, not the one wrapped for ghost differentiation.
        handles.append(self.model.register_forward_hook(CopyInert(self._root_post_hook)))

    def unregister(self) -> None:
        """Undo what :meth:`register` left on the modules besides the handles."""
        for m in self.bw_modules:
            if not m._backward_hooks:
                m._is_full_backward_hook = None
        for plan in self.plan.modules:
            for n in plan.loose:
                plan.module.__dict__.pop(n, None)

    def begin_forward(self, module, args, kwargs=None):
        """The root's forward pre-hook: a new step if the last one is complete, the BatchNorm
        check, the batch size."""
        rec = self.rec
        # kwargs=None, no handles: a detached set still listed in a forward that re-planned
        # the hooks (torch calls the hooks it had listed when the forward started)
        if torch.is_grad_enabled() and not in_backward() and not rec.paused and rec.handles:
            rec.new_step_if_done()
            mixing = [n for n, m in self.plan.batchnorms if m.training or m.running_mean is None]
            if mixing:
                raise UnsupportedModuleError(
                    f"BatchNorm module(s) {', '.join(mixing[:6])} use batch statistics: each sample's output depends "
                    "on the others, so no per-sample gradient exists. dpzoo.make_dp_ready(model) converts them to "
                    "GroupNorm; or put them in eval mode with running statistics."
                )
            x = first_tensor(tuple(args) + tuple((kwargs or {}).values()))
            if x is not None and x.dim() > 0:
                rec.step.batch_size = x.shape[0]
        return None

    def _root_post_hook(self, module, args, output):
        rec = self.rec
        if not torch.is_grad_enabled() or in_backward() or rec.paused:
            return None
        rec.step.root_ran = True
        found = output_tensors(output)
        rec.step.outputs.extend(found)  # several forward passes may feed one loss
        rec.step.calls.append(found)
        if self.wrap is not None and found:
            return self.wrap(output, found)
        return None

    def _version_hook(self, module, args, kwargs):
        if torch.is_grad_enabled() and not self.rec.paused:
            ins = tuple(args) or tuple(v for v in kwargs.values() if isinstance(v, torch.Tensor))[:1]
            self.rec.pending.setdefault(id(module), []).append(
                tuple([a._version if isinstance(a, torch.Tensor) else None for a in ins])
            )
        return None

    def _forward_hook(self, plan: ModulePlan):
        rec = self.rec

        def hook(module, args, kwargs, output):
            if rec.paused:
                return None
            pending = rec.pending.get(id(module))
            versions = pending.pop() if pending else None
            if not torch.is_grad_enabled() or not isinstance(output, torch.Tensor) or not output.requires_grad:
                return None
            rec.new_step_if_done()
            if not args:  # called as layer(input=x)
                args = tuple(v for v in kwargs.values() if isinstance(v, torch.Tensor))[:1]
            now = tuple([a._version if isinstance(a, torch.Tensor) else None for a in args])  # lists: one frame
            if versions is not None and now != versions:
                raise UnsupportedModuleError(
                    f"{plan.name} ({type(module).__name__}) modified its own input in place during forward; "
                    "its per-sample gradient cannot be computed from the stored input. Switch the "
                    "in-place option off (dpzoo.make_dp_ready does)."
                )
            b = rec.step.batch_size
            x = first_tensor(args)
            if x is None or x.dim() == 0:
                raise UnsupportedModuleError(f"{plan.name} ({type(module).__name__}) got no batched tensor input.")
            if not self.note_aliases(plan, module):
                raise UnsupportedModuleError(SWAPPED.format(name=plan.name, kind=type(module).__name__))
            expanded = None
            if (
                plan.broadcast_lookup
                and b is not None
                and b > 1
                and x.shape[0] == 1
                and not x.is_floating_point()
                and output.shape[0] == 1
            ):
                # Position ids of batch 1 broadcast over the batch (HF): give every sample
                # its own lookup, so the table's gradient splits per sample (exact).
                args = tuple(a.expand(b, *a.shape[1:]) if isinstance(a, torch.Tensor) else a for a in args)
                output = expanded = output.expand(b, *output.shape[1:])
                x = args[0]
            if b is not None and x.shape[0] != b:
                raise UnsupportedModuleError(
                    f"{plan.name} ({type(module).__name__}) got an input with {x.shape[0]} rows in its first "
                    f"dimension but the batch has {b} samples. Per-sample gradients need every hooked layer to "
                    "take batch-first inputs (no sequence-first, flattened or unbatched inputs)."
                )
            acts = tuple([a.detach() if isinstance(a, torch.Tensor) else a for a in args])
            source = gradient_source(output, args)
            tensors.refuse_hooks_ahead(plan.name, module, self.first_hooks.get(id(module)))
            use = Use(
                module,
                plan.name,
                plan.params,
                acts,
                versions if versions is not None else now,
                output,
                torch.autograd.graph.get_gradient_edge(source),
                view_of=tensors.view_of(output, source),
                batch_size=x.shape[0],
            )
            tensors.on_gradient(source, self._grad_catcher(use))
            rec.step.uses.append(use)
            return expanded  # None (output unchanged) unless expanded

        return hook

    def _output_grad_hook(self, plan: ModulePlan):
        """An activation-free layer's first forward hook: a :class:`Use` with the gradient of the layer's own
        output each time a backward reaches it (not a full backward pre-hook, run after every forward hook)."""
        rec_ref, module_ref, name, params = weakref.ref(self.rec), weakref.ref(plan.module), plan.name, plan.params

        def hook(module, args, kwargs, output):
            out = output if isinstance(output, torch.Tensor) else first_tensor(output)
            if out is None or not out.requires_grad or not torch.is_grad_enabled() or self.rec.paused:
                return None
            tensors.refuse_hooks_ahead(plan.name, module, self.first_hooks.get(id(module)))
            if not self.note_aliases(plan, module):  # swapped parameters: the gradient is another tensor's
                raise UnsupportedModuleError(SWAPPED.format(name=plan.name, kind=type(module).__name__))
            source = gradient_source(out, tuple(args) + tuple(kwargs.values()) if kwargs else args)
            view = tensors.view_of(out, source)
            # weak references only: the hook lives in the autograd graph, out of the garbage collector's sight
            tensors.on_gradient(source, lambda grad: _record_output_grad(rec_ref, module_ref, name, params, grad, view))
            return None

        return hook

    def note_aliases(self, plan: ModulePlan, module: nn.Module) -> bool:
        """Note FSDP2's unsharded stand-ins for ``plan``'s parameters in this step; False if a
        parameter slot holds any other tensor (a swap the rule cannot attribute)."""
        for n, t in zip(plan.params, plan.tensors):
            now = module._parameters.get(n)
            if now is t:
                continue
            if not stands_in(t, now):
                return False
            note_alias(self.rec.step.aliases, t, now)
            if id(now) not in self.seen_aliases:  # FSDP2 keeps one unsharded tensor per parameter
                self.seen_aliases.add(id(now))
                if self.on_alias is not None:
                    self.on_alias(t, now)
        return True

    def _alias_pre_hook(self, plan: ModulePlan):
        def hook(module, args):
            if torch.is_grad_enabled() and not self.rec.paused and not in_backward():
                self.rec.new_step_if_done()
                if not self.note_aliases(plan, module):
                    raise UnsupportedModuleError(
                        f"The parameters of {plan.name} ({type(module).__name__}) were swapped for other tensors "
                        "during this forward: dpzoo's rule would attribute the gradient to the wrong tensor."
                    )
            return None

        return hook

    def _grad_catcher(self, use: Use):
        # Weak references only: the hook lives on the output's autograd node, and a strong
        # reference back to the record (which holds that output) would form a cycle through
        # C++ that Python's garbage collector cannot see, leaking every step's activations.
        use_ref, rec_ref = weakref.ref(use), weakref.ref(self.rec)

        def catch(grad):
            rec, u = rec_ref(), use_ref()
            if rec is None or u is None or rec.by_edges:
                return  # step already dropped, or hooks.backward collects it from its edge
            grad = tensors.as_output(grad.detach(), u.view_of)
            u.grad = grad if u.grad is None else u.grad + grad
            rec.step.backward_done = True

        return catch

    def _backward_hook(self, plan: ModulePlan):  # rules with grad_from: the gradient at a submodule's input
        rec_ref, module_ref = weakref.ref(self.rec), weakref.ref(plan.module)

        def hook(module, grad_input, grad_output):
            if grad_input[0] is not None:
                _record_output_grad(rec_ref, module_ref, plan.name, plan.params, grad_input[0])

        return hook

    def _loose_pre_hook(self, plan: ModulePlan):
        rec = self.rec

        def hook(module, args, kwargs=None):
            x = first_tensor(args)
            if x is None or not torch.is_grad_enabled() or in_backward() or rec.paused:
                return None
            rec.new_step_if_done()
            b = x.shape[0]
            for n in plan.loose:
                p = getattr(module, n)
                # a per-sample copy, detached from p: any use of p itself is then visible
                copy = p.detach().expand(b, *p.shape[1:]).clone().requires_grad_(True)
                module.__dict__[n] = copy  # shadows the registered parameter during forward
                use = Use(
                    module,
                    plan.name,
                    (n,),
                    output=copy,
                    edge=torch.autograd.graph.get_gradient_edge(copy),
                    loose=True,
                    batch_size=b,
                )
                copy.register_hook(self._grad_catcher(use))
                rec.step.uses.append(use)
            return None

        return hook

    def _loose_post_hook(self, plan: ModulePlan):
        def hook(module, args, output):
            for n in plan.loose:
                module.__dict__.pop(n, None)
            return None

        return hook


def _record_output_grad(rec_ref, module_ref, name: str, params: tuple, grad: torch.Tensor, view=None) -> None:
    """One use of an activation-free layer in this backward pass: its output gradient. The record and
    the layer are held weakly: the hook lives on the output's autograd node (see Capture._grad_catcher)."""
    rec, module = rec_ref(), module_ref()
    if rec is None or module is None or rec.paused:
        return
    grad = tensors.as_output(grad.detach() if grad.requires_grad else grad, view)  # requires_grad: create_graph
    # the backward pass: the user's, also when ghost differentiation runs inside it
    task = rec.pass_id if rec.by_edges else torch._C._current_graph_task_id()
    rec.step.uses.append(Use(module, name, params, grad=grad, batch_size=grad.shape[0], task=task))
    rec.step.backward_done = True
