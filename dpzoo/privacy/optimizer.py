"""The DP optimizer: clipped sums from the norm hooks, Gaussian noise once per logical step.

One logical step (BK paper Algorithm 1, lines 6–12):

1. for each physical micro-batch, per-sample norms ‖g_i‖ from the hooks, clip factors
   C_i (Abadi: min(1, R/‖g_i‖); automatic: R/(‖g_i‖ + 0.01), Bu et al.), and the clipped sum
   Σ_i C_i g_i by book-keeping (no second backward), accumulated;
2. at the end of the logical batch: under ``torch.distributed``, the sums are all-reduced
   and rank 0 alone adds the noise, so the global noise is exactly N(0, σ²R²) per
   coordinate; noise goes on trainable parameters only;
3. with ``loss_reduction="mean"``, the noisy sum is divided by the expected logical batch
   size q·N (Poisson sampling), as in Opacus; ``"sum"`` leaves it a sum;
4. the wrapped optimizer steps; the accountant records (σ, q).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from ..errors import NoGradientWarning, UnsupportedModuleError
from ..grad_norms.hooks import NormHooks
from .accountant import Accountant
from .data import StepSignal

__all__ = ["DPOptimizer", "clip_factors", "CLIPPING"]

CLIPPING = ("abadi", "automatic")
AUTOMATIC_GAMMA = 0.01  # stability constant of automatic clipping (Bu et al., AUTO-S)


def clip_factors(norms: torch.Tensor, max_grad_norm: float, clipping: str) -> torch.Tensor:
    """C_i with ‖C_i g_i‖ ≤ R: Abadi min(1, R/‖g‖) or automatic R/(‖g‖ + 0.01)."""
    if clipping == "abadi":
        return (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
    if clipping == "automatic":
        return max_grad_norm / (norms + AUTOMATIC_GAMMA)
    raise ValueError(f"clipping must be one of {CLIPPING}, got {clipping!r}")


class DPOptimizer:
    """Wraps a torch optimizer; ``step()`` replaces ``.grad`` by the private gradient first."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, hooks: NormHooks, noise_multiplier: float,
                 max_grad_norm: float, clipping: str = "abadi", loss_reduction: str = "mean",
                 expected_batch_size: float, sample_rate: float, accountant: Accountant,
                 signal: StepSignal | None = None, noise_seed: int | None = None):
        if clipping not in CLIPPING:
            raise ValueError(f"clipping must be one of {CLIPPING}, got {clipping!r}")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if max_grad_norm <= 0 or noise_multiplier < 0:
            raise ValueError(f"need max_grad_norm > 0 and noise_multiplier >= 0, got {max_grad_norm}, {noise_multiplier}")
        self.original_optimizer = optimizer
        self.hooks = hooks
        self.noise_multiplier, self.max_grad_norm = float(noise_multiplier), float(max_grad_norm)
        self.clipping, self.loss_reduction = clipping, loss_reduction
        self.expected_batch_size, self.sample_rate = float(expected_batch_size), float(sample_rate)
        self.accountant = accountant
        self.signal = signal or StepSignal()
        self._noise_seed = noise_seed if noise_seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        self._generators: dict[torch.device, torch.Generator] = {}
        self._summed: dict[str, torch.Tensor] = {}
        self._written: dict[str, torch.Tensor] = {}  # the private .grad tensors this optimizer set
        self._warned_no_grad: set[str] = set()
        self._reached: set[str] = set()  # parameters some sample's gradient reached in this logical step
        self.samples_in_step = 0
        self.steps = 0
        self.last_per_sample_norms: torch.Tensor | None = None

    # -- the wrapped optimizer -------------------------------------------------------------
    @property
    def param_groups(self):
        return self.original_optimizer.param_groups

    @property
    def state(self):
        return self.original_optimizer.state

    @property
    def defaults(self):
        return self.original_optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizer": self.original_optimizer.state_dict(), "steps": self.steps,
                "noise_seed": self._noise_seed,
                "generators": {str(d): g.get_state() for d, g in self._generators.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.original_optimizer.load_state_dict(state["optimizer"])
        self.steps, self._noise_seed = state["steps"], state["noise_seed"]
        for dev, st in state.get("generators", {}).items():
            self._generator(torch.device(dev)).set_state(st)

    def __repr__(self) -> str:
        return (f"DPOptimizer(σ={self.noise_multiplier:.4g}, R={self.max_grad_norm}, clipping={self.clipping}, "
                f"reduction={self.loss_reduction}, wrapping {type(self.original_optimizer).__name__})")

    # -- DP --------------------------------------------------------------------------------
    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            g = torch.Generator(device=device)
            g.manual_seed(self._noise_seed)
            self._generators[device] = g
        return self._generators[device]

    def accumulate(self) -> None:
        """Add this micro-batch's clipped sum to the logical step (called by ``step()``)."""
        st = self.hooks._state
        if not st.backward_done:
            return  # no backward for this micro-batch (e.g. an empty Poisson batch was skipped)
        if self.hooks.ghost_backward and st.outputs:
            # With ghost differentiation nothing but this optimizer writes .grad: a gradient
            # there came from a use of the parameter outside the model (e.g. in the loss).
            for name, p in self.hooks._params.items():
                if p.grad is not None and p.grad is not self._written.get(name):
                    raise UnsupportedModuleError(
                        f"Parameter {name} received a gradient outside dpzoo's hooks (is it used in the loss or "
                        "outside the model's forward, e.g. a weight penalty or a tied projection?). Its "
                        "per-sample gradient cannot be clipped; compute every use inside the model, or "
                        "use the optimizer's weight_decay for penalties.")
        norms = self.hooks.per_sample_norms()
        b = norms.shape[0]
        if b:
            unreached = set(self.hooks.unreached_parameters())
            self._reached.update(n for n in self.hooks._params if n not in unreached)
        if b:
            true_norms = norms * b if self.loss_reduction == "mean" else norms
            factors = clip_factors(true_norms, self.max_grad_norm, self.clipping)
            scale = factors * b if self.loss_reduction == "mean" else factors
            for name, g in self.hooks.clipped_sum(scale.detach()).items():
                self._summed[name] = self._summed[name] + g if name in self._summed else g
            self.last_per_sample_norms = true_norms.detach()
        self.samples_in_step += b
        self.hooks.clear()

    def _private_gradients(self) -> None:
        params = self.hooks._params
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        rank = dist.get_rank() if world > 1 else 0
        std = self.noise_multiplier * self.max_grad_norm
        if self.samples_in_step:
            self._warn_no_gradient([n for n in params if n not in self._reached])
        self._reached = set()
        for name, p in params.items():
            g = self._summed.get(name)
            g = torch.zeros_like(p) if g is None else g.to(p.dtype)
            # rank 0 draws the noise once for everyone: the all-reduced sum holds N(0, σ²R²)
            noise = torch.normal(0.0, std, size=p.shape, generator=self._generator(p.device),
                                 device=p.device, dtype=p.dtype) if std > 0 else None
            if noise is not None and rank == 0:
                g = g + noise
            if world > 1:
                dist.all_reduce(g)
            if self.loss_reduction == "mean":
                g = g / self.expected_batch_size
            p.grad = g
            self._written[name] = g
        self._summed = {}

    def _warn_no_gradient(self, names: list[str]) -> None:
        """Once per parameter: trainable, yet no sample of a whole logical step reached it (unused
        in forward, or its path was detached). Still private (it gets noise like every
        parameter), but almost always a bug that silently stops it from learning."""
        new = [n for n in names if n not in self._warned_no_grad]
        if not new:
            return
        self._warned_no_grad.update(new)
        shown = ", ".join(new[:8]) + (f" and {len(new) - 8} more" if len(new) > 8 else "")
        warnings.warn(
            f"Trainable parameter(s) {shown} received no gradient in a DP step of {self.samples_in_step} "
            "samples: they are moved by noise only. If they are not meant to train, freeze them "
            "(requires_grad_(False)) before make_private; if they are, check that the forward pass uses them "
            "and does not detach their path (e.g. a result reassigned under torch.no_grad()).",
            NoGradientWarning, stacklevel=5)  # the caller of opt.step()

    def pre_step(self) -> bool:
        """Accumulate; at the end of a logical step write private ``.grad``s. True if it did."""
        self.accumulate()
        if not self.signal.last_physical:
            return False
        self._private_gradients()
        self.accountant.step(self.noise_multiplier, self.sample_rate)
        self.steps += 1
        self.samples_in_step = 0
        return True

    def step(self, closure=None):
        if closure is not None:
            with torch.enable_grad():
                closure()
        if self.pre_step():
            return self.original_optimizer.step()
        return None
