"""The DP optimizer: clipped sums from the norm hooks, Gaussian noise once per logical step.

One logical step (BK paper Algorithm 1, lines 6–12):

1. for each physical micro-batch, per-sample norms ‖g_i‖ from the hooks (per user, g_U = Σ_{i∈U} g_i,
   when the loader samples users: :mod:`dpzoo.privacy.users`), clip factors C_i (Abadi:
   min(1, R/‖g_i‖); automatic: R/(‖g_i‖ + 0.01), Bu et al.), and the clipped sum Σ_i C_i g_i by
   book-keeping (no second backward), accumulated (:meth:`clip_and_accumulate`; a micro-batch
   is taken when the next forward pass starts or at ``step()``, so several forward/backward
   passes before one ``step()`` add up instead of overwriting each other);
2. at the end of the logical batch the step is checked: its micro-batches clipped exactly the
   rows of one logical batch of the loader, once (:meth:`check_step`); then under
   ``torch.distributed`` the sums are all-reduced and rank 0 alone adds the noise, so the global
   noise is exactly N(0, σ²R²) per coordinate (:meth:`add_noise`); noise goes on trainable
   parameters only;
3. with ``loss_reduction="mean"``, the noisy sum is divided by the expected logical batch
   size q·N (Poisson sampling), as in Opacus (:meth:`scale_grad`); ``"sum"`` leaves it a sum;
4. the wrapped optimizer steps; the accountant records (σ, q).

Like Opacus' ``DPOptimizer`` this is a :class:`torch.optim.Optimizer` sharing the wrapped optimizer's
``param_groups`` and ``state``; its clip / noise / scale steps are methods a subclass can override.

Noise is secret: each logical step draws it from a generator seeded with 64 fresh bits of OS
entropy (``os.urandom``). ``noise_seed`` makes it reproducible instead, for tests only: anyone
holding the seed can subtract the noise (a :class:`~dpzoo.errors.ReproducibleNoiseWarning`,
and the privacy metadata says so).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from ..errors import PrivacyUsageError, UnsupportedModuleError
from ..grad_norms.hooks import NormHooks
from ..grad_norms.loss_pool import check_reduction, take_record
from .accounting.accountant import Accountant
from .budget import restore_history
from .clipping import AUTOMATIC_GAMMA as AUTOMATIC_GAMMA  # re-exported: it was defined here
from .clipping import CLIPPING, clip_factors
from .data import StepSignal, secret_generator
from .distributed import noised_all_reduce, noised_all_reduce_many
from .no_gradient import warn_no_gradient
from .scaled_samples import nonfinite_samples, refuse_torch_grad_scaler, unscaled_cotangents
from .wrapped_optimizer import WrappedOptimizer

__all__ = ["DPOptimizer", "clip_factors", "CLIPPING"]


class DPOptimizer(WrappedOptimizer):
    """Wraps a torch optimizer; ``step()`` replaces ``.grad`` by the private gradient first."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        hooks: NormHooks,
        noise_multiplier: float,
        max_grad_norm: float,
        clipping: str = "abadi",
        loss_reduction: str = "mean",
        expected_batch_size: float,
        sample_rate: float,
        accountant: Accountant,
        signal: StepSignal | None = None,
        noise_seed: int | None = None,
    ):
        if clipping not in CLIPPING:
            raise PrivacyUsageError(f"clipping must be one of {CLIPPING}, got {clipping!r}")
        if loss_reduction not in ("mean", "sum"):
            raise PrivacyUsageError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if not max_grad_norm > 0 or not noise_multiplier >= 0:
            raise PrivacyUsageError(
                f"need max_grad_norm > 0 and noise_multiplier >= 0, got {max_grad_norm}, {noise_multiplier}"
            )
        super().__init__(optimizer)
        self.hooks = hooks
        self.noise_multiplier, self.max_grad_norm = float(noise_multiplier), float(max_grad_norm)
        self.clipping, self.loss_reduction = clipping, loss_reduction
        self.expected_batch_size, self.sample_rate = float(expected_batch_size), float(sample_rate)
        self.accountant = accountant
        self.signal = signal or StepSignal()
        self.noise_seed = noise_seed
        self._generators: dict[torch.device, torch.Generator] = {}  # reproducible mode only
        # p, clipped sum -> p's private .grad; set by the engine under FSDP2 (dpzoo.privacy.fsdp)
        self.grad_writer: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None
        self._summed: dict[str, torch.Tensor] = {}
        self._written: dict[str, torch.Tensor] = {}  # the private .grad tensors this optimizer set
        self._own_noise = False  # this step's .grads are views of dpzoo's own noise buffer, held by nothing else
        self._warned_no_grad: set[str] = set()
        self._reached: set[str] = set()  # parameters some sample's gradient reached in this logical step
        self._step_hooks: list[Callable[["DPOptimizer"], None]] = []
        self.samples_in_step = self.micro_batches_in_step = 0
        self._step_batch: int | None = None  # logical_index of the micro-batches taken in this step
        self._pending_batch: int | None = None  # logical_index of the forward whose records the hooks hold
        self._pending_groups: torch.Tensor | None = None  # and its rows' privacy units (user-level DP)
        self._last_stepped: int | None = None  # logical_index of the last completed step
        self.steps = 0
        self.last_per_sample_norms: torch.Tensor | None = None
        # set by DPGradScaler: the loss's scale; drop (not refuse) samples whose gradient is not finite
        self.loss_scale, self.drop_nonfinite = 1.0, False
        self.nonfinite_samples = 0  # dropped so far (private: a count over raw samples, never released)
        # set by the engine: its first-step self-check, its inputs, the per-step parameter check
        self.on_first_step: Callable[[], None] | None = None
        self.capture_inputs: Callable[[], tuple] | None = None
        self._first_capture: tuple | None = None
        self.check_parameters: Callable[[], None] | None = None
        self.check_state: Callable[[], None] | None = None  # the engine's watch on buffers / parameters
        self.refusal: Exception | None = None  # a failed self-check: every later step is refused too

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The wrapped optimizer's state and the step count; the noise generators' state only in
        reproducible mode (``noise_seed``): secret noise leaves nothing that predicts it."""
        out = {
            "optimizer": self.original_optimizer.state_dict(),
            "steps": self.steps,
            "accountant": self.accountant.state_dict(),
        }  # a resume continues the spending
        if self.noise_seed is not None:
            out["noise_seed"] = self.noise_seed
            out["generators"] = {str(d): g.get_state() for d, g in self._generators.items()}
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore a checkpoint, the privacy spent before it included: the accountant's history
        is the checkpoint's (composed after any history this optimizer's accountant already had,
        e.g. a DP-FROST selection, unless that is the checkpoint's own beginning)."""
        if "optimizer" not in state:  # a plain torch optimizer's state dict: no privacy record
            raise PrivacyUsageError(
                "This is not a DPOptimizer state dict (no accountant in it): the steps it took would vanish from ε. "
                "Save and load optimizer.state_dict() of the DPOptimizer, or engine.state_dict()."
            )
        restore_history(self.accountant, state)
        self.original_optimizer.load_state_dict(state["optimizer"])
        self.steps = state["steps"]
        if self.noise_seed is not None and state.get("noise_seed") is not None:
            self.noise_seed = state["noise_seed"]
            for dev, st in state.get("generators", {}).items():
                self.generator_for(torch.device(dev)).set_state(st)

    def __repr__(self) -> str:
        return (
            f"DPOptimizer(σ={self.noise_multiplier:.4g}, R={self.max_grad_norm}, clipping={self.clipping}, "
            f"reduction={self.loss_reduction}, wrapping {type(self.original_optimizer).__name__})"
        )

    def attach_step_hook(self, fn: Callable[["DPOptimizer"], None]) -> None:
        """``fn(optimizer)`` after every logical step, noise-only ones included (e.g. an LR schedule's step)."""
        self._step_hooks.append(fn)

    def signal_skip_step(self, do_skip: bool = True) -> None:
        """Opacus' BatchMemoryManager protocol, refused: it splits batches behind dpzoo's loader's back."""
        raise PrivacyUsageError(
            "Opacus' BatchMemoryManager cannot split dpzoo's batches: use dpzoo.privacy.BatchMemoryManager "
            "(the same arguments) or make_private(max_physical_batch_size=...)."
        )

    def take_first_capture(self) -> tuple | None:
        """What the engine's first-step self-check re-runs, handed over once: ``(inputs, output
        cotangents)`` of the first micro-batch (kept when :attr:`on_first_step` and
        :attr:`capture_inputs` are set); None before it is captured and after it is taken."""
        capture, self._first_capture = self._first_capture, None
        return capture

    # -- DP: overridable steps -------------------------------------------------------------
    def generator_for(self, device: torch.device) -> torch.Generator:
        """The generator of this step's noise on ``device`` (fresh OS entropy, or the seeded one)."""
        if self.noise_seed is None:
            return secret_generator(device)  # fresh OS entropy for every draw
        if device not in self._generators:
            g = torch.Generator(device=device)
            g.manual_seed(self.noise_seed)
            self._generators[device] = g
        return self._generators[device]

    def clip_factors(self, norms: torch.Tensor) -> torch.Tensor:
        """Per-sample factors C_i with ‖C_i g_i‖ ≤ R (override for another clipping function)."""
        return clip_factors(norms, self.max_grad_norm, self.clipping)

    def mark_forward(self) -> None:
        """Called by the engine when a training forward pass starts: takes the previous
        micro-batch if its backward ran, and tags the records that follow with the loader's
        current logical batch."""
        if self.hooks.step_ready:
            with self._aborting():
                self.clip_and_accumulate()
        elif self._pending_batch is not None and self._pending_batch != self.signal.logical_index:
            # forwards of an earlier batch no backward followed (validation without no_grad): drop them
            self.hooks.clear()
            self._pending_batch = None
        if self._pending_batch is None:
            self._pending_batch, self._pending_groups = self.signal.logical_index, self.signal.groups

    @contextlib.contextmanager
    def _aborting(self):
        """A refused micro-batch or step is dropped whole (nothing released): the next starts clean."""
        try:
            yield
        except BaseException:
            self.hooks.clear()
            self._summed, self._reached = {}, set()
            self.samples_in_step = self.micro_batches_in_step = 0
            self._step_batch = self._pending_batch = self._pending_groups = None
            raise

    def clip_and_accumulate(self) -> None:
        """Add the current micro-batch's clipped sum to the logical step."""
        if not self.hooks.step_ready:
            return  # no backward for this micro-batch
        batch_tag, groups = self._pending_batch, self._pending_groups
        self._pending_batch = self._pending_groups = None
        if batch_tag is None:  # a forward the engine did not see (its hooks detached): the current batch
            batch_tag, groups = self.signal.logical_index, self.signal.groups
        if self._step_batch is not None and batch_tag != self._step_batch:
            self.hooks.clear()
            raise PrivacyUsageError(
                "Forward/backward passes of two different logical batches before one optimizer.step(): one noise "
                "draw would cover two Poisson batches (the accounted mechanism has one). Call optimizer.step() "
                "after each batch from the loader; for gradient accumulation over physical micro-batches, pass "
                "max_physical_batch_size to make_private and keep calling step() after each micro-batch."
            )
        params = self.hooks.trainable_parameters
        if self.hooks.ghost_backward and self.hooks.forward_calls:
            # With ghost differentiation nothing but this optimizer writes .grad: a gradient
            # there came from a use of the parameter outside the model (e.g. in the loss).
            for name, p in params.items():
                if p.grad is not None and p.grad is not self._written.get(name):
                    raise UnsupportedModuleError(
                        f"Parameter {name} received a gradient outside dpzoo's hooks (is it used in the loss or "
                        "outside the model's forward, e.g. a weight penalty or a tied projection?). Its "
                        "per-sample gradient cannot be clipped; compute every use inside the model, or "
                        "use the optimizer's weight_decay for penalties."
                    )
        if groups is not None:  # user-level DP: a user's rows are one unit, its gradient their sum
            self.hooks.group_rows(groups)
        norms = self.hooks.per_sample_norms()
        b = norms.shape[0] if groups is None else groups.numel()  # rows (examples); norms: one per unit
        drop = nonfinite_samples(norms, self.drop_nonfinite)
        self.nonfinite_samples += int(drop.sum()) if drop is not None else 0
        if b:
            check_reduction(take_record(), self.loss_reduction, b)  # a watched loss, reduced as the engine scales
            unreached = set(self.hooks.unreached_parameters())
            self._reached.update([n for n in params if n not in unreached])
            # the hooks saw the gradients of loss_scale · loss: norms and sums are linear in it
            norms = norms / self.loss_scale
            true_norms = norms * b if self.loss_reduction == "mean" else norms
            factors = self.clip_factors(true_norms)
            if drop is not None:  # a sample whose gradient is not finite contributes exactly 0
                factors = factors.masked_fill(drop, 0.0)
            scale = factors * b if self.loss_reduction == "mean" else factors
            for name, g in self.hooks.clipped_sum((scale / self.loss_scale).detach(), drop, True).items():
                self._summed[name] = self._summed[name] + g if name in self._summed else g
            self.last_per_sample_norms = true_norms.detach()
            if self.on_first_step is not None and self._first_capture is None and self.capture_inputs is not None:
                inputs = self.capture_inputs()
                if inputs is not None:
                    cotangents = unscaled_cotangents(self.hooks.output_cotangents(0), self.loss_scale)
                    self._first_capture = (inputs, cotangents)
        self.loss_scale = 1.0  # DPGradScaler.scale() sets it again for the next micro-batch
        self.samples_in_step += b
        self.micro_batches_in_step += 1
        self._step_batch = batch_tag
        self.hooks.clear()

    def check_step(self) -> None:
        """Refuse a step whose clipped rows are not exactly one logical batch of the loader."""
        sig = self.signal
        if sig.logical_index < 0:
            raise PrivacyUsageError(
                "optimizer.step() before any batch came from the data loader make_private returned: dpzoo accounts "
                "Poisson-sampled batches from that loader only. Iterate the returned loader, not the original one."
            )
        if self._last_stepped == sig.logical_index:
            raise PrivacyUsageError(
                f"A second optimizer.step() on logical batch {sig.logical_index}: each Poisson batch is one step of "
                "the mechanism. Take the next batch from the loader before stepping again."
            )
        if self.micro_batches_in_step and self._step_batch != sig.logical_index:
            raise PrivacyUsageError(
                "optimizer.step() clipped samples of an earlier logical batch than the loader's current one: step "
                "after each batch, before taking the next from the loader."
            )
        if self.samples_in_step != sig.logical_batch_size:
            raise PrivacyUsageError(
                f"This step clipped {self.samples_in_step} rows but the loader's logical batch has "
                f"{sig.logical_batch_size} samples. dpzoo clips dimension 0 of the model's input as the batch: "
                "pass batch-first inputs (no time-major / sequence-first layout), run every sample of the batch "
                "through exactly one forward/backward before step() (none twice, none skipped), and iterate the "
                "loader make_private returned."
            )

    def add_noise(self) -> None:
        """``p.grad`` = clipped sum over all ranks + N(0, σ²R²) once per coordinate, for all at once
        (:func:`.distributed.noised_all_reduce_many`), by an override of :meth:`replicated_grad` or FSDP2's writer."""
        params = self.hooks.trainable_parameters
        if self.samples_in_step:
            warn_no_gradient(self._warned_no_grad, [n for n in params if n not in self._reached], self.samples_in_step)
        self._reached = set()
        summed, writer, tensors = [self._summed.get(name) for name in params], self.grad_writer, list(params.values())
        overridden = not _as_defined(self, "replicated_grad")
        self._own_noise = not overridden and writer is None and _as_defined(self, "add_noise")
        if overridden or (writer is not None and not hasattr(writer, "write_many")):  # the override writes each
            grads = [(writer or self.replicated_grad)(p, s) for p, s in zip(tensors, summed)]
        elif writer is not None:
            grads = writer.write_many(tensors, summed)
        else:
            std, seeded = self.noise_multiplier * self.max_grad_norm, self.noise_seed is not None
            grads = noised_all_reduce_many(tensors, summed, std, self.generator_for, seeded)
        for (name, p), g in zip(params.items(), grads):
            p.grad = g
            self._written[name] = g
        self._summed = {}

    def replicated_grad(self, p: torch.Tensor, summed: torch.Tensor | None) -> torch.Tensor:
        """A replicated parameter's private gradient (:func:`~dpzoo.privacy.distributed.noised_all_reduce`)."""
        std, seeded = self.noise_multiplier * self.max_grad_norm, self.noise_seed is not None
        return noised_all_reduce(p, summed, std, self.generator_for(p.device) if seeded else None, seeded)

    def scale_grad(self) -> None:
        """``loss_reduction="mean"``: the noisy sums divided by the expected logical batch size: in place where
        dpzoo's own add_noise and scale_grad run on views of its noise buffer (nothing else holds them), else
        into new tensors (an override or wrapper may hold what add_noise wrote; a reviewer's case, 2026-11-27)."""
        if self.loss_reduction == "mean":
            named = [(name, p) for name, p in self.hooks.trainable_parameters.items() if p.grad is not None]
            own, self._own_noise = self._own_noise, False  # used once: a later add_noise may be another's
            if own and _as_defined(self, "add_noise") and _as_defined(self, "scale_grad"):  # no second buffer
                torch._foreach_div_([p.grad for _, p in named], self.expected_batch_size)
                return
            for (name, p), g in zip(named, torch._foreach_div([p.grad for _, p in named], self.expected_batch_size)):
                p.grad = g
                self._written[name] = g

    def _drop_frozen(self) -> None:
        """Parameters frozen (requires_grad_(False)) after make_private: no update. Their norms were
        part of the clipping of this step, which only makes it more conservative."""
        for name, p in self.hooks.trainable_parameters.items():
            if not p.requires_grad:
                p.grad = None
                self._written.pop(name, None)

    def pre_step(self) -> bool:
        """Accumulate; at the end of a logical step write private ``.grad``s. True if it did."""
        if self.refusal is not None:
            self.hooks.clear()
            raise type(self.refusal)(
                f"Refused: the first step's self-check failed, so no step of this engine is taken ({self.refusal})"
            )
        with self._aborting():
            self.clip_and_accumulate()
            if not self.signal.last_physical:
                return False
            self.check_step()
            if self.check_parameters is not None:
                self.check_parameters()
            if self.check_state is not None:
                self.check_state()
            if self.on_first_step is not None and self._first_capture is not None:
                try:
                    self.on_first_step()
                except Exception as e:
                    self.refusal = e
                    raise
                self.on_first_step = None
        self._own_noise = False  # set by dpzoo's own add_noise only (a replacement may not call it)
        self.add_noise()
        self.scale_grad()
        self._drop_frozen()
        self.accountant.step(self.noise_multiplier, self.sample_rate)
        self.steps += 1
        self._last_stepped = self.signal.logical_index
        self.samples_in_step = self.micro_batches_in_step = 0
        self._step_batch = None
        return True

    _step_supports_amp_scaling = True  # torch's GradScaler then hands step() its state: refused

    def step(self, closure=None):
        refuse_torch_grad_scaler(self)
        if closure is not None:
            with torch.enable_grad():
                closure()
        if self.pre_step():
            out = self.original_optimizer.step()
            for fn in self._step_hooks:
                fn(self)
            return out
        return None


def _as_defined(opt: DPOptimizer, name: str) -> bool:
    """Whether ``opt``'s method ``name`` is DPOptimizer's own: not a subclass's, a patch or an instance's wrapper."""
    return name not in vars(opt) and getattr(type(opt), name) is _OWN[name]


_OWN = {name: getattr(DPOptimizer, name) for name in ("add_noise", "replicated_grad", "scale_grad")}  # as defined here
