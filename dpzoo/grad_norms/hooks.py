"""``attach_norm_hooks``: per-sample gradient norms and clipped sums for every trainable
parameter of a model, in one backward pass.

How it works (BK paper, Algorithm 1):

1. forward: a hook on each layer with a trainable weight keeps the layer's input (the
   activation) and hooks its output tensor; layers whose only trainable parameters are
   biases get a backward hook alone and store nothing (DP-BiTFiT Algorithm 1, App. B);
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
per-sample gradients. Anything else raises :class:`~dpzoo.UnsupportedModuleError`.

Privacy unit: one sample = one row of the batch (batch-first); for sequence models the
whole sequence. Losses must be per-sample losses *summed* (``reduction="sum"``); with a
mean, every per-sample gradient is divided by B.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch import nn

from ..errors import UnsupportedModuleError
from . import reps as R
from .registry import Rule, find_rule

__all__ = ["attach_norm_hooks", "NormHooks", "MODES"]

MODES = ("auto", "ghost", "instantiate")


@dataclass
class _Use:
    """One call of a hooked module (or one swap of a loose tensor) in the current step."""

    module: nn.Module
    module_name: str
    params: tuple[str, ...]  # local names of the trainable parameters it covers
    activations: tuple | None = None
    versions: tuple | None = None
    output: torch.Tensor | None = None  # what ghost differentiation differentiates
    grad: torch.Tensor | None = None
    loose: bool = False


@dataclass
class _ModulePlan:
    name: str
    module: nn.Module
    rule: Rule | None
    params: tuple[str, ...]  # trainable local parameter names this module owns
    needs_activations: bool
    loose: tuple[str, ...] = ()


@dataclass
class _State:
    uses: list[_Use] = field(default_factory=list)
    backward_done: bool = False
    batch_size: int | None = None  # from the root module's input
    task_id: int | None = None  # autograd graph task of the backward pass that filled it
    outputs: list = field(default_factory=list)  # the model's output tensors (for the use check)
    graph_checked: bool = False
    reps: dict | None = None
    sq_norms: dict | None = None


def _first_tensor(args) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    return None


class _GhostBackward(torch.autograd.Function):
    """Identity on the model's outputs whose backward differentiates only to the hooked layers.

    The outputs handed to the user are cut from the model graph (their only input is a
    fresh leaf, ``anchor``); their backward runs ``autograd.grad`` from the real outputs to
    the hooked layers' outputs (ghost differentiation), so ``loss.backward()`` computes no
    weight gradient and leaves ``.grad`` alone.
    """

    @staticmethod
    def forward(ctx, hooks, real_outputs, anchor, *detached):
        ctx.hooks, ctx.real_outputs = hooks, real_outputs
        return tuple(d.view_as(d) for d in detached)

    @staticmethod
    def backward(ctx, *grads):
        outs = [(o, g) for o, g in zip(ctx.real_outputs, grads) if g is not None]
        if outs:
            ctx.hooks._ghost_differentiate([o for o, _ in outs], [g for _, g in outs])
        ctx.real_outputs = None
        return (None, None, None) + (None,) * len(grads)


class NormHooks:
    """Handle returned by :func:`attach_norm_hooks`. See the module docstring."""

    def __init__(self, model: nn.Module, mode: str = "auto", ghost_backward: bool = False):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.model, self.mode = model, mode
        self.ghost_backward = ghost_backward
        self._state = _State()
        self._handles: list = []
        self._plans: list[_ModulePlan] = []
        self._attached = True
        self._build_plan()
        self._register()

    # -- planning -------------------------------------------------------------------------
    def _build_plan(self) -> None:
        names: dict[int, list[str]] = {}
        for full, p in self.model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(full)
        self._param_names = {pid: ns[0] for pid, ns in names.items()}  # canonical names
        self._params = {self._param_names[id(p)]: p for p in self.model.parameters() if p.requires_grad}
        if not self._params:
            raise UnsupportedModuleError("The model has no trainable parameters (requires_grad=False everywhere).")
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
            if rule is not None:
                why = rule.unsupported(module)
                if why:
                    raise UnsupportedModuleError(
                        f"Module {label} ({type(module).__name__}): {why}; its trainable parameter(s) "
                        f"{', '.join(f'{mname}.{n}' if mname else n for n in own)} cannot be clipped per sample.")
                extra = [n for n in own if n not in rule.params]
                if extra:
                    raise UnsupportedModuleError(
                        f"Module {label} ({type(module).__name__}) has trainable parameter(s) "
                        f"{', '.join(extra)} that its per-sample rule does not cover. Freeze them "
                        "(requires_grad_(False)) or register a rule with dpzoo.grad_norms.register_rule.")
                needs = any(n not in rule.activation_free for n in own)
                self._plans.append(_ModulePlan(mname, module, rule, own, needs))
                continue
            bad = [n for n in own if getattr(module, n).dim() == 0 or getattr(module, n).shape[0] != 1]
            if bad:
                raise UnsupportedModuleError(
                    f"Module {label} ({type(module).__name__}) has no per-sample-gradient rule for its "
                    f"trainable parameter(s) {', '.join(f'{mname}.{n}' if mname else n for n in bad)}. "
                    "dpzoo will not leave them unclipped: freeze them (requires_grad_(False)), "
                    "replace the layer, or register a rule with dpzoo.grad_norms.register_rule.")
            # Loose tensors with a leading dimension of 1 (cls_token, pos_embed, ...)
            self._plans.append(_ModulePlan(mname, module, None, own, True, loose=own))

    # -- hooks ----------------------------------------------------------------------------
    def _register(self) -> None:
        state = weakref.proxy(self._state)
        if any(p.needs_activations for p in self._plans):
            # the batch size, to expand layers fed a batch-1 input broadcast over the batch
            self._handles.append(self.model.register_forward_pre_hook(self._root_pre_hook, with_kwargs=True))
            self._handles.append(self.model.register_forward_hook(self._root_post_hook))
        for plan in self._plans:
            m = plan.module
            if plan.loose:
                self._handles.append(m.register_forward_pre_hook(self._loose_pre_hook(plan)))
                self._handles.append(m.register_forward_hook(self._loose_post_hook(plan), always_call=True))
            elif plan.needs_activations:
                self._handles.append(m.register_forward_hook(self._forward_hook(plan), with_kwargs=True))
            elif plan.rule.grad_from is not None:  # activation-free via a submodule's input gradient
                self._handles.append(plan.rule.grad_from(m).register_full_backward_hook(
                    self._backward_hook(plan, use_grad_input=True)))
            else:  # activation-free: output gradient only, no forward hook, nothing stored
                self._handles.append(m.register_full_backward_hook(self._backward_hook(plan)))
        del state

    def _new_step_if_done(self) -> None:
        if self._state.backward_done:
            self._state = _State()

    def _root_pre_hook(self, module, args, kwargs):
        if torch.is_grad_enabled():
            self._new_step_if_done()
            x = _first_tensor(tuple(args) + tuple(kwargs.values()))
            if x is not None and x.dim() > 0:
                self._state.batch_size = x.shape[0]
        return None

    def _root_post_hook(self, module, args, output):
        if torch.is_grad_enabled():
            found, stack = [], [output]
            while stack:  # tensors inside tuples, dicts and ModelOutputs
                o = stack.pop()
                if isinstance(o, torch.Tensor):
                    if o.grad_fn is not None:
                        found.append(o)
                elif isinstance(o, dict):
                    stack.extend(o.values())
                elif isinstance(o, (list, tuple)):
                    stack.extend(o)
            self._state.outputs = found
            if self.ghost_backward and found:
                return self._wrap_outputs(output, found)
        return None

    def _wrap_outputs(self, output, found):
        anchor = torch.zeros((), requires_grad=True)
        wrapped = _GhostBackward.apply(self, tuple(found), anchor, *[t.detach() for t in found])
        mapping = {id(t): w for t, w in zip(found, wrapped)}

        def rebuild(o):
            if isinstance(o, torch.Tensor):
                return mapping.get(id(o), o)
            if isinstance(o, dict):  # dicts and transformers' ModelOutput
                for k in list(o.keys()):
                    o[k] = rebuild(o[k])
                return o
            if isinstance(o, tuple) and not hasattr(o, "_fields"):
                return tuple(rebuild(x) for x in o)
            if isinstance(o, list):
                return [rebuild(x) for x in o]
            return o
        return rebuild(output)

    def _forward_hook(self, plan: _ModulePlan):
        def hook(module, args, kwargs, output):
            if not torch.is_grad_enabled() or not isinstance(output, torch.Tensor) or not output.requires_grad:
                return None
            self._new_step_if_done()
            if not args:  # called as layer(input=x)
                args = tuple(v for v in kwargs.values() if isinstance(v, torch.Tensor))[:1]
            b = self._state.batch_size
            x = _first_tensor(args)
            expanded = None
            if b is not None and b > 1 and x is not None and x.dim() > 0 and x.shape[0] == 1 \
                    and output.dim() > 0 and output.shape[0] == 1:
                # A batch-1 input broadcast over the batch (HF's position_ids): give every
                # sample its own copy, so the layer's gradient splits per sample (exact).
                args = tuple(a.expand(b, *a.shape[1:]) if isinstance(a, torch.Tensor) and a.dim() > 0
                             and a.shape[0] == 1 else a for a in args)
                output = expanded = output.expand(b, *output.shape[1:])
            acts = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
            use = _Use(module, plan.name, plan.params, acts,
                       tuple(a._version if isinstance(a, torch.Tensor) else None for a in args), output)
            output.register_hook(self._grad_catcher(use))
            self._state.uses.append(use)
            return expanded  # None (output unchanged) unless expanded
        return hook

    def _grad_catcher(self, use: _Use):
        def catch(grad):
            use.grad = grad.detach() if use.grad is None else use.grad + grad.detach()
            self._state.backward_done = True
        return catch

    def _backward_hook(self, plan: _ModulePlan, use_grad_input: bool = False):
        def hook(module, grad_input, grad_output):
            grad = grad_input[0] if use_grad_input else grad_output[0]
            if grad is None:
                return None
            # Without forward hooks (bias-only) a new step shows as a new backward pass.
            task = torch._C._current_graph_task_id()
            if self._state.task_id is not None and self._state.task_id != task:
                self._state = _State()
            self._state.task_id = task
            self._state.uses.append(_Use(plan.module, plan.name, plan.params, grad=grad.detach()))
            self._state.backward_done = True
            return None
        return hook

    def _loose_pre_hook(self, plan: _ModulePlan):
        def hook(module, args, kwargs=None):
            x = _first_tensor(args)
            if x is None or not torch.is_grad_enabled():
                return None
            self._new_step_if_done()
            b = x.shape[0]
            for n in plan.loose:
                p = getattr(module, n)
                # a per-sample copy, detached from p: any use of p itself is then visible
                copy = p.detach().expand(b, *p.shape[1:]).clone().requires_grad_(True)
                module.__dict__[n] = copy  # shadows the registered parameter during forward
                use = _Use(module, plan.name, (n,), output=copy, loose=True)
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
        if self.ghost_backward and self._state.outputs:
            loss.backward()  # the outputs are wrapped: this is ghost differentiation already
            return
        self._check_graph([loss])
        self._ghost_differentiate([loss], None)

    def _ghost_differentiate(self, roots: list, grads: list | None) -> None:
        targets = [u.output for u in self._state.uses if u.output is not None and u.output.requires_grad]
        for plan in self._plans:  # bias-only layers: their backward hooks fire on the way
            if not plan.needs_activations:
                targets += [getattr(plan.module, n) for n in plan.params if getattr(plan.module, n).requires_grad]
        if not targets:
            raise RuntimeError("No hooked layer took part in this forward pass; nothing to differentiate.")
        with warnings.catch_warnings():
            # torch warns when a hooked layer's inputs need no gradient (the first layer's
            # never do): expected here, since only output gradients are wanted
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            torch.autograd.grad(roots, targets, grads, allow_unused=True)
        self._state.backward_done = True

    def _check_graph(self, roots: list) -> None:
        """Every direct use of a trainable parameter must be one dpzoo recorded."""
        if roots and all(r.grad_fn is None for r in roots):
            raise RuntimeError("loss does not require grad: did the forward pass run under no_grad?")
        self._state.graph_checked = True
        edges: dict[int, int] = {}
        stack, seen = [r.grad_fn for r in roots], set()
        while stack:
            fn = stack.pop()
            if fn is None or id(fn) in seen:
                continue
            seen.add(id(fn))
            for nxt, _ in fn.next_functions:
                if nxt is None:
                    continue
                var = getattr(nxt, "variable", None)
                if var is not None:
                    edges[id(var)] = edges.get(id(var), 0) + 1
                else:
                    stack.append(nxt)
        recorded: dict[int, int] = {}
        for u in self._state.uses:
            if u.loose:
                continue
            for n in u.params:
                pid = id(getattr(u.module, n))
                recorded[pid] = recorded.get(pid, 0) + 1
        for plan in self._plans:
            if plan.needs_activations or plan.loose:
                continue
            for n in plan.params:  # bias-only modules are recorded during backward: count calls later
                recorded.setdefault(id(getattr(plan.module, n)), 10**9)
        for name, p in self._params.items():
            if edges.get(id(p), 0) > recorded.get(id(p), 0):
                raise UnsupportedModuleError(
                    f"Parameter {name} is used {edges[id(p)]} time(s) in this forward pass but dpzoo "
                    f"recorded {recorded.get(id(p), 0)}: it is used outside the module that owns it "
                    "(e.g. `x @ module.weight` in another module's forward). Its per-sample gradient "
                    "cannot be accounted for; route every use through a module, or freeze it.")

    # -- results ----------------------------------------------------------------------------
    def _collect(self) -> dict[str, list]:
        st = self._state
        if st.reps is not None:
            return st.reps
        if not st.backward_done:
            raise RuntimeError("No backward pass since the last forward: call hooks.backward(loss) "
                               "or loss.backward() first.")
        if not st.graph_checked and st.outputs:  # loss.backward() was used: check from the outputs
            self._check_graph(st.outputs)
        by_param: dict[str, list] = {n: [] for n in self._params}
        for use in st.uses:
            if use.grad is None:
                continue  # output did not reach the loss
            if use.loose:
                n = use.params[0]
                name = self._param_names[id(use.module._parameters[n])]
                by_param[name].append(R.Dense(use.grad.unsqueeze(1)))
                continue
            plan_rule = find_rule(use.module)
            if use.versions is not None:
                for a, v in zip(use.activations, use.versions):
                    if isinstance(a, torch.Tensor) and a._version != v:
                        raise UnsupportedModuleError(
                            f"The input of {use.module_name} was modified in place after the layer used "
                            "it; its per-sample gradient would be wrong. Remove the in-place op "
                            "(dpzoo.make_dp_ready switches off the usual ones).")
            out = plan_rule.fn(use.module, use.activations, use.grad, set(use.params))
            for local, rep in out.items():
                by_param[self._param_names[id(getattr(use.module, local))]].append(rep)
        sizes = {(n, r.batch_size) for n, rs in by_param.items() for r in rs}
        if len({b for _, b in sizes}) > 1:
            detail = ", ".join(sorted(f"{n}: {b}" for n, b in sizes))
            raise UnsupportedModuleError(
                "Layers saw different batch sizes in one step, so per-sample gradients cannot be "
                f"matched across them ({detail}). Every hooked layer must take batch-first inputs.")
        missing = [n for n, rs in by_param.items() if not rs]
        for n in missing:  # unused in this step: zero gradient
            p = self._params[n]
            by_param[n] = [R.Dense(torch.zeros(self._batch_size(by_param), *p.shape, dtype=p.dtype, device=p.device))]
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
            out = {}
            for name, rs in self._collect().items():
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

    def per_sample_norms(self) -> torch.Tensor:
        """Tensor[B]: ‖∂L_i/∂θ‖₂ over all trainable parameters θ."""
        sq = list(self.per_param_sq_norms().values())
        return torch.stack([s.to(torch.float64 if s.dtype == torch.float64 else torch.float32) for s in sq]).sum(0).sqrt()

    def clipped_sum(self, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        """{parameter name: Σ_i scale[i] · ∂L_i/∂θ} (book-keeping: no second backward)."""
        reps = self._collect()
        b = self._batch_size(reps)
        if scale.dim() != 1 or scale.shape[0] != b:
            raise ValueError(f"scale must be a Tensor[{b}] (one factor per sample), got shape {tuple(scale.shape)}")
        out = {}
        for name, rs in reps.items():
            total = R.clipped_sum(rs[0], scale)
            for r in rs[1:]:
                total = total + R.clipped_sum(r, scale)
            out[name] = total.to(self._params[name].dtype)
        return out

    @property
    def parameter_names(self) -> list[str]:
        return list(self._params)

    @property
    def batch_size(self) -> int:
        return self._batch_size(self._collect())

    def clear(self) -> None:
        """Drop the stored activations and gradients of the current step."""
        self._state = _State()

    def detach(self) -> None:
        """Remove every hook; the model is left as it was."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for plan in self._plans:
            for n in plan.loose:
                plan.module.__dict__.pop(n, None)
        self.clear()
        self._attached = False

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


_ = Iterable
