"""``attach_norm_hooks``: per-sample gradient norms and clipped sums for every trainable
parameter of a model, in one backward pass. This module is the public handle
(:class:`NormHooks`, its contract with DP engines); the work is split by job:

* :mod:`.plan`: which module covers which parameter, by which rule (at attach);
* :mod:`.capture`: the forward hooks recording a step, and loose-tensor swaps;
* :mod:`.ghost`: ghost differentiation (``hooks.backward``, ``ghost_backward=True``);
* :mod:`.audit`: the graph audit (edge counts, stray gradients, version checks);
* :mod:`.assembly`: records → one :class:`~.param_grad.ParamGrad` per parameter (:mod:`.reps`: its uses);
* :mod:`.cost`: ghost norm or instantiation per use, by estimated time within a memory budget;

How it works (BK paper, Algorithm 1):

1. forward: a hook on each layer with a trainable weight keeps the layer's input (the
   activation) and hooks its output tensor; layers whose only trainable parameters are
   biases store nothing: a hook on their output keeps its gradient (DP-BiTFiT Algorithm 1, App. B);
2. backward: each hooked output's gradient is book-kept. ``hooks.backward(loss)`` asks
   autograd only for these output gradients (ghost differentiation), so no weight gradient
   is computed; ``loss.backward()`` works too;
3. the layer rules (``dpzoo.grad_norms.rules``) turn (activation, output gradient) into
   exact per-sample gradient representations, whose norms (ghost or instantiated, by the
   planner of :mod:`.cost`) and clipped sums Σ_i C_i g_i are computed on request.

Parameters used several times (tied embeddings, modules called twice) get exact norms from
all cross terms (Phantom Clipping). Trainable "loose" tensors a module owns directly (ViT
``cls_token``) are swapped for per-sample copies if the owner's type is declared in
:data:`LOOSE_TENSORS` (:mod:`dpzoo.grad_norms.rules.loose`). Anything else raises
:class:`~dpzoo.UnsupportedModuleError`, and so does, each step, a use of a trainable parameter
dpzoo did not record (counted in the autograd graph).

Privacy unit: one row of the batch (batch-first; a whole sequence), or the rows
:meth:`NormHooks.group_rows` puts together (a user's examples). Losses are per-sample losses
*summed* (``reduction="sum"``); with a mean, every per-sample gradient is divided by B.
"""

from __future__ import annotations

import contextlib

import torch
import torch._dynamo
from torch import nn

from ..errors import InvalidArgumentError, PrivacyUsageError, UnsupportedModuleError
from ..live_ref import LiveRef
from . import reps as R
from .assembly import assemble
from .audit import check_step, count_edges, stray_grad_hook
from .autocast import no_autocast
from .capture import Capture, Recorder, Use, output_tensors
from .cost import check_autotune, check_budget
from .float_guard import round_up
from .ghost import ghost_differentiate, wrap_outputs
from .half import exact_matmuls, shared_scale
from .loss_pool import unwatched
from .param_grad import ParamGrad, clipped_sums, total_sq_norms
from .plan import plan_model
from .rounding import mechanism_dtype
from .rules.loose import (
    BROADCAST_LOOKUPS,
    LOOSE_CHECKS,
    LOOSE_TENSORS,
    register_broadcast_lookup,
    register_loose_tensors,
)
from .units import unit_layout

__all__ = ["attach_norm_hooks", "attached_norm_hooks", "NormHooks", "MODES", "output_tensors"]
__all__ += ["LOOSE_TENSORS", "LOOSE_CHECKS", "register_loose_tensors", "BROADCAST_LOOKUPS", "register_broadcast_lookup"]

MODES = ("auto", "ghost", "instantiate")


class NormHooks:
    """Handle returned by :func:`attach_norm_hooks`. See the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        mode: str = "auto",
        ghost_backward: bool = False,
        memory_budget: float | None = None,
        autotune: bool | None = None,
    ):
        if mode not in MODES:
            raise InvalidArgumentError(f"mode must be one of {MODES}, got {mode!r}")
        self.memory_budget = check_budget(memory_budget)
        self.autotune = check_autotune(autotune)
        self._last_costs: dict | None = None
        if attached_norm_hooks(model) is not None:
            raise UnsupportedModuleError(
                "This model already has dpzoo's norm hooks (it was made private, or hooked, before): call "
                "engine.detach() on the engine that made it private, or dpzoo.grad_norms.attached_norm_hooks(model)"
                ".detach(), first (two sets would split the records)."
            )
        self.model, self.mode = model, mode
        self.ghost_backward = ghost_backward
        self._owned: frozenset | None = None  # ids of the model's parameters, for sample_rows
        self._rec = Recorder()
        self._plan = plan_model(model)
        self._capture = Capture(
            model,
            self._plan,
            self._rec,
            wrap=self._wrap_outputs if ghost_backward else None,
            on_alias=self._watch_alias if ghost_backward else None,
        )
        # the root pre-hook is this handle's own method: the model keeps the handle alive
        self._capture.register(root_pre_hook=self.begin_forward)
        if ghost_backward:
            # Ghost differentiation computes no parameter gradient (bias-only parameters only
            # inside it): one reaching a parameter comes from a use dpzoo cannot see (e.g. in
            # the loss, whose graph dpzoo does not walk on loss.backward()).
            for name, p in self._plan.params.items():
                self._rec.handles.append(p.register_hook(stray_grad_hook(self._rec, name)))
        model._dpzoo_norm_hooks = LiveRef(self)
        # torch.compile: dynamo skips guards on module hooks by default, so a graph traced from a
        # model without these hooks (this one before, or another instance of its class) would run
        # here without them: guard hooks from now on, and drop what a compiled model traced before
        torch._dynamo.config.skip_nnmodule_hook_guards = False
        if any(isinstance(m, torch._dynamo.eval_frame.OptimizedModule) for m in model.modules()):
            torch._dynamo.reset()

    def _watch_alias(self, planned: torch.Tensor, stand_in: torch.Tensor) -> None:
        # FSDP2's unsharded parameter is what autograd accumulates into: watch it for stray
        # gradients as the planned parameter is watched (dpzoo.grad_norms.sharded)
        name = self._plan.param_names[id(planned)]
        self._rec.handles.append(stand_in.register_hook(stray_grad_hook(self._rec, name)))

    # -- capture and ghost differentiation ----------------------------------------------------
    def begin_forward(self, module: nn.Module, args: tuple, kwargs: dict | None = None) -> None:
        """The root module's forward pre-hook: starts a new step if the last one is complete,
        checks BatchNorm, records the batch size. Call it by hand for a forward whose hooks were
        attached after it started (an engine re-planning the hooks in its own pre-hook)."""
        return self._capture.begin_forward(module, args, kwargs)

    def _wrap_outputs(self, output, found):
        if self._owned is None:
            self._owned = frozenset(id(p) for p in self.model.parameters())
        return wrap_outputs(self._rec, self._ghost_differentiate, output, found, self._owned, self.model)

    def _ghost_differentiate(self, roots: list, grads: list | None) -> None:
        ghost_differentiate(self._rec, self._plan, roots, grads)

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate ``loss`` computing only what the per-sample norms need.

        Autograd computes the output gradients of hooked layers and the gradients of
        bias-only layers, but no weight gradient (BK's ghost differentiation); parameters'
        ``.grad`` are left as they were.
        """
        st = self._rec.step
        if st.backward_done:
            raise UnsupportedModuleError(
                "A backward pass already ran since the last forward (loss.backward() or hooks.backward()); "
                "hooks.backward(loss) would add this loss's per-sample gradients to it. Call hooks.backward "
                "once per forward pass, and not after loss.backward() (several loss.backward() calls in "
                "one step add up)."
            )
        if self.ghost_backward and st.outputs:
            count_edges(st, [loss])  # uses of parameters in the loss are checked too
            loss.backward()  # the outputs are wrapped: this is ghost differentiation already
            return
        self._ghost_differentiate([loss], None)

    # -- results ----------------------------------------------------------------------------
    @no_autocast()
    def _grads(self) -> dict[str, ParamGrad]:
        st = self._rec.step
        if st.grads is None:
            check_step(st, self._plan.params)
            st.grads = assemble(st, self._plan, self._ghost_flag(), self.memory_budget, self.autotune)
            self._last_costs = st.costs
        return st.grads

    def plan(self) -> list[dict]:
        """Per use of each trainable parameter in the current step: ghost norm or instantiation,
        why, and both paths' estimated GFLOP and MB (:mod:`dpzoo.grad_norms.cost`). Made from the
        shapes of the step after its backward pass (or of the last step assembled)."""
        if self._rec.step.uses and self._rec.step.backward_done:
            self._grads()
        if self._last_costs is None:
            raise PrivacyUsageError(
                "The plan is made from the shapes of a step: run a forward and a backward pass of the hooked model first."
            )
        return [c.as_dict() for cs in self._last_costs.values() for c in cs]

    @staticmethod
    def _batch_size(grads) -> int:
        for g in grads.values():
            return g.batch_size
        raise PrivacyUsageError(
            "No per-sample gradient was recorded in this step: run a forward and a backward pass of the hooked model first."
        )

    def _ghost_flag(self) -> bool | None:
        return {"auto": None, "ghost": True, "instantiate": False}[self.mode]

    @no_autocast()
    @exact_matmuls()  # entered once for the ~100s of products of a step's norms (and sums, below)
    def per_param_sq_norms(self) -> dict[str, torch.Tensor]:
        """{parameter name: Tensor[B]} of ‖∂L_i/∂θ‖₂² (every use of a parameter, cross terms included)."""
        st = self._rec.step
        if st.sq_norms is None:
            grads = self._grads()
            total_sq_norms(list(grads.values()))  # the step's paths (a freed use formed as the step forms it), cached
            st.sq_norms = {name: g.sq_norm() for name, g in grads.items()}
        return st.sq_norms

    def per_param_norms(self) -> dict[str, torch.Tensor]:
        """{parameter name: Tensor[B]} of ‖∂L_i/∂θ‖₂."""
        return {n: v.sqrt() for n, v in self.per_param_sq_norms().items()}

    def unreached_parameters(self) -> list[str]:
        """Trainable parameters no gradient reached in this step (their per-sample gradients are 0)."""
        self._grads()
        return list(self._rec.step.unreached)

    def per_sample_norms(self) -> torch.Tensor:
        """Tensor[B]: ‖∂L_i/∂θ‖₂ over all trainable parameters θ (float32 or float64)."""
        sq = total_sq_norms(list(self._grads().values()))
        dtype = torch.float64 if any(s.dtype == torch.float64 for s in sq) else torch.float32
        # summed in float64 and rounded up: rounding to nearest could read a clipped sample short
        same = len({s.dtype for s in sq}) == 1  # one cast of the stack, not one per parameter
        rows = torch.stack(sq).double() if same else torch.stack([s.double() for s in sq])
        return round_up(rows.sum(0).sqrt(), dtype)

    @no_autocast()
    def clipped_sum(
        self, scale: torch.Tensor, drop: torch.Tensor | None = None, mechanism_precision: bool = False
    ) -> dict[str, torch.Tensor]:
        """{parameter name: Σ_i scale[i] · ∂L_i/∂θ} (book-keeping: no second backward). Samples
        where ``drop`` (bool Tensor[B]) is True contribute exactly 0, even if their gradients are
        not finite (float16 overflow under a loss scale). Each sum is in its parameter's dtype, or
        with ``mechanism_precision`` in :func:`~dpzoo.grad_norms.rounding.mechanism_dtype` (float32
        for half-precision parameters: add the noise there, then cast)."""
        grads = self._grads()
        b = self._batch_size(grads)
        if scale.dim() != 1 or scale.shape[0] != b:
            raise InvalidArgumentError(
                f"scale must be a Tensor[{b}] (one factor per sample), got shape {tuple(scale.shape)}"
            )
        if drop is not None and (drop.dtype != torch.bool or tuple(drop.shape) != (b,)):
            raise InvalidArgumentError(f"drop must be a bool Tensor[{b}], got {drop.dtype} {tuple(drop.shape)}")
        # one factor per sample for every parameter, so that no block of the sample's gradient is
        # scaled otherwise than the rest (.half.shared_scale; per parameter it is needed for exactness)
        scale = shared_scale([r for g in grads.values() for r in g.reps], scale)
        out = clipped_sums(grads, scale, drop)
        for name, total in out.items():
            dtype = self._plan.params[name].dtype
            out[name] = total.to(mechanism_dtype(dtype) if mechanism_precision else dtype)
        return out

    @no_autocast()
    def per_sample_grads(self, row_sparse: bool = False) -> dict[str, "torch.Tensor | R.RowSparse"]:
        """{parameter name: Tensor[B, *shape]}: the per-sample gradients themselves, every use of
        a parameter summed (tied embeddings included). Memory B × parameters: use small physical
        batches. For what needs more than norms (DP-FROST's element-wise |g| and ℓ1 norms).

        ``row_sparse=True``: an embedding used only by lookups comes back as
        :class:`~dpzoo.grad_norms.reps.RowSparse` (the rows each sample touched), not B dense tables."""
        out: dict[str, torch.Tensor | R.RowSparse] = {}
        for name, g in self._grads().items():
            sparse = g.row_sparse() if row_sparse else None
            if sparse is not None:
                out[name] = sparse
                continue
            out[name] = g.instantiate().to(self._plan.params[name].dtype)
        return out

    @property
    def parameter_names(self) -> list[str]:
        return list(self._plan.params)

    # -- the contract with DP engines (dpzoo.privacy) and tests --------------------------------
    @property
    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        """{canonical name: parameter} of every parameter these hooks clip (trainable at attach)."""
        return dict(self._plan.params)

    @property
    def attached(self) -> bool:
        """True until :meth:`detach`: the hooks are registered on the model."""
        return bool(self._rec.handles)

    @property
    def records(self) -> tuple[Use, ...]:
        """The uses recorded in the current step, in order (one per call of a hooked module, swap of a
        loose tensor, or activation-free output gradient received); ``activations`` is None once
        assembled or on the activation-free path. For inspection: do not modify."""
        return tuple(self._rec.step.uses)

    @property
    def step_ready(self) -> bool:
        """True once a backward pass ran since the last forward: the step's records are complete."""
        return self._rec.step.backward_done

    @property
    def forward_calls(self) -> int:
        """Root forward passes recorded in the current step."""
        return len(self._rec.step.calls)

    def output_cotangents(self, call: int = 0) -> list[torch.Tensor] | None:
        """The gradients that reached the outputs of root forward ``call`` in this step (with
        ``ghost_backward=True``), in :func:`output_tensors` order; zeros for an output the loss
        did not use; None if that call is unknown."""
        calls, cotangents = self._rec.step.calls, self._rec.step.cotangents
        return [cotangents.get(id(o), torch.zeros_like(o)) for o in calls[call]] if call < len(calls) else None

    def backward_from(self, outputs: list[torch.Tensor], cotangents: list[torch.Tensor]) -> None:
        """Back-propagate given output gradients (a vector-Jacobian product) to the hooked layers,
        without weight gradients: ``hooks.backward`` for a loss given by its output gradients."""
        if self.ghost_backward:
            with unwatched():  # dpzoo's own cotangents, not a loss
                torch.autograd.backward(outputs, cotangents)  # the outputs are wrapped: ghost differentiation
        else:
            self._ghost_differentiate(list(outputs), list(cotangents))

    @contextlib.contextmanager
    def paused(self):
        """Forward and backward passes inside record nothing and are not wrapped: plain autograd
        on the model (the self-check's single-sample reference passes)."""
        was, self._rec.paused = self._rec.paused, True
        try:
            yield self
        finally:
            self._rec.paused = was

    @property
    def batch_size(self) -> int:
        return self._batch_size(self._grads())

    def group_rows(self, groups) -> None:
        """Clip this step's rows in privacy units: ``groups[i]`` (ids 0 … U−1) is row i's unit (a
        user); norms and sums are then per unit (:mod:`dpzoo.grad_norms.units`). Before the first norm."""
        if self._rec.step.grads is not None:
            raise PrivacyUsageError("group_rows after this step's norms were taken: call it before the first norm.")
        self._rec.step.groups = unit_layout(groups)

    def clear(self) -> None:
        """Drop the stored activations and gradients of the current step."""
        self._rec.clear()

    def detach(self) -> None:
        """Remove every hook; the model is left as it was."""
        for h in self._rec.handles:
            h.remove()
        self._rec.handles.clear()
        self._capture.unregister()
        self.clear()
        if getattr(self.model, "_dpzoo_norm_hooks", None) is not None:
            self.model._dpzoo_norm_hooks = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.detach()

    def describe(self) -> list[str]:
        """One line per hooked module: its rule and whether it stores activations."""
        return self._plan.describe()


def attached_norm_hooks(model: nn.Module) -> NormHooks | None:
    """The :class:`NormHooks` attached to ``model`` (not detached), or None."""
    ref = getattr(model, "_dpzoo_norm_hooks", None)
    hooks = ref() if ref is not None else None
    # a deep copy of the model carries the original's reference: its hooks are not on the copy
    return hooks if hooks is not None and hooks.attached and hooks.model is model else None


def attach_norm_hooks(
    model: nn.Module,
    mode: str = "auto",
    *,
    ghost_backward: bool = False,
    memory_budget: float | None = None,
    autotune: bool | None = None,
) -> NormHooks:
    """Hook every trainable parameter of ``model`` for per-sample norms and clipped sums.

    ``mode``: ``"auto"`` chooses ghost norm or instantiation per use of each layer by estimated
    time, the instantiated per-sample gradients within ``memory_budget`` bytes (None: half of
    the device's free memory; :mod:`dpzoo.grad_norms.cost`; ``hooks.plan()`` shows the choices),
    by a multiply-add model with a memory-traffic term, or with ``autotune=True`` (None: on CUDA) by
    timing each linear layer's two paths once per shape (plans then depend on timings: not reproducible
    bit for bit across runs, and ranks may differ; ``hooks.autotune`` can be set after attach);
    ``"ghost"`` / ``"instantiate"`` force one. Raises
    :class:`~dpzoo.UnsupportedModuleError` naming any trainable parameter it cannot cover.

    ``ghost_backward=True``: the model's outputs are returned through a node whose backward
    differentiates only to the hooked layers, so a plain ``loss.backward()`` is BK's ghost
    differentiation (no weight gradient, ``.grad`` untouched). dpzoo's engine uses this.
    """
    return NormHooks(model, mode, ghost_backward=ghost_backward, memory_budget=memory_budget, autotune=autotune)
