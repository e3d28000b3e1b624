"""What a private model's engine does around every training forward pass and step: follow
freezing and unfreezing, hand micro-batches to the optimizer, watch buffers and parameters,
run the first-step self-check, and take the noise-only step of an empty Poisson batch.

:class:`TrainingWatch` is installed by :meth:`~dpzoo.privacy.engine.PrivacyEngine.make_private`
(forward hooks on the model, callbacks on the :class:`~dpzoo.privacy.optimizer.DPOptimizer`
and the loader's :class:`~dpzoo.privacy.data.StepSignal`) and removed by ``detach``.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Callable

import torch

from ..errors import DPZooError, WeakPrivacyWarning
from ..grad_norms.autocast import no_autocast
from ..grad_norms.copy_inert import CopyInert
from .caller import first_frame_outside_dpzoo
from .data import StepSignal
from .guards import StateWatch, check_step_parameters, trainable_changed
from .model_walk import named_modules
from .verify import self_check

if TYPE_CHECKING:
    from .engine import PrivacyEngine

__all__ = ["TrainingWatch"]


class TrainingWatch:
    """The per-forward and per-step duties of ``engine`` (which has made its model private).

    ``replan`` re-attaches the engine's norm hooks for the current trainable set (after freezing
    or unfreezing); ``self_check`` / ``self_check_samples`` are make_private's. The first-step
    self-check's outcome goes to ``engine.self_check_result``.
    """

    def __init__(
        self,
        engine: PrivacyEngine,
        signal: StepSignal,
        *,
        replan: Callable[[], None],
        self_check: bool,
        self_check_samples: int,
        loader=None,
    ):
        self.engine = engine
        self.self_check, self.self_check_samples = bool(self_check), int(self_check_samples)
        self._replan = replan
        self._state = StateWatch(engine.module)
        self._check_inputs = None
        self.loader = loader  # the engine's: its first batch is collated again by the self-check
        self._in_check = False
        optimizer = engine.optimizer
        optimizer.check_parameters = self.check_parameters
        optimizer.check_state = self._state.check_step
        if self.self_check:
            optimizer.on_first_step = self.run_self_check
            optimizer.capture_inputs = lambda: self._check_inputs
        signal.on_empty = self.noise_only_step
        self.handles = [
            engine.module.register_forward_pre_hook(CopyInert(self.on_forward), with_kwargs=True, prepend=True),
            engine.module.register_forward_hook(CopyInert(self.after_forward)),
        ]

    def remove(self) -> None:
        """Remove the forward hooks from the model."""
        for h in self.handles:
            h.remove()
        self.handles = []

    def check_parameters(self) -> None:
        """At each step: the optimizer still trains exactly the hooked parameters; the first step past
        the steps σ was calibrated for says so (ε then exceeds the target)."""
        engine = self.engine
        check_step_parameters(engine.module, engine.hooks, engine.optimizer)
        if engine.planned_steps is not None and engine.optimizer.steps == engine.planned_steps:
            warnings.warn(
                f"step {engine.planned_steps + 1} is past the {engine.planned_steps} steps σ = "
                f"{engine.noise_multiplier:.3g} was calibrated for: ε now exceeds the target (engine.get_epsilon() "
                "reports it, and the saved metadata records it).",
                WeakPrivacyWarning,
                stacklevel=first_frame_outside_dpzoo(),
            )

    def on_forward(self, module, args, kwargs):
        """Before every training forward: follow freezing/unfreezing, take the previous
        micro-batch, keep the first batch's inputs for the self-check."""
        if self._in_check or not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return None
        engine, optimizer = self.engine, self.engine.optimizer
        modules = named_modules(engine.module)  # one walk for both checks below, unless hooks are re-planned
        if trainable_changed(engine.module, engine.hooks, modules):
            if optimizer.hooks.step_ready:
                optimizer.clip_and_accumulate()
            # re-plan the hooks for the new trainable set; their root pre-hook missed this call
            self._replan()
            engine.hooks.begin_forward(module, args, kwargs)
            modules = None  # walked again below
        optimizer.mark_forward()
        if self.self_check and optimizer.on_first_step is not None and engine.hooks.forward_calls == 0:
            self._check_inputs = (args, kwargs)
        # this optimizer's first step, not the accountant's: a model with earlier spending
        # (dpzoo.load, DP-FROST) still has its parameters checked over its first step here
        self._state.start_forward(first_step=optimizer.steps == 0, modules=modules)
        return None

    def after_forward(self, module, args, output):
        """After every training forward: no buffer changed during it."""
        if self._in_check or not torch.is_grad_enabled():
            return None
        self._state.compare_buffers("a training forward pass")
        return None

    def noise_only_step(self) -> None:
        """An empty Poisson batch: the mechanism still releases a (noise-only) update."""
        self.engine.optimizer.step()
        self.engine.optimizer.zero_grad(set_to_none=True)

    def run_self_check(self) -> None:
        """The first step's self-check (:func:`dpzoo.privacy.verify.self_check`) on the inputs the
        optimizer captured; its outcome is recorded in ``engine.self_check_result``."""
        engine = self.engine
        capture = engine.optimizer.take_first_capture()
        if capture is None:
            return
        (args, kwargs), cotangents = capture
        self._in_check = True
        try:
            with torch.enable_grad(), no_autocast():  # the check's own passes run in the model's dtype
                report = self_check(
                    engine.module,
                    engine.hooks,
                    args,
                    kwargs,
                    cotangents=cotangents,
                    samples=self.self_check_samples,
                    loader=self.loader,
                )
        except DPZooError as e:
            engine.self_check_result = f"failed: {e}"
            raise
        finally:
            self._in_check = False
        engine.self_check_result = (
            f"passed on the first step ({len(report.samples)} samples, largest relative "
            f"difference {max(report.worst.values(), default=0.0):.1e})"
        )
