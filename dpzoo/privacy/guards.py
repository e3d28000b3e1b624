"""The checks that keep ε true while training: the optimizer trains exactly the hooked
parameters, the model is called with its own parameters, and nothing computed from a batch is
stored outside the DP update (buffers, parameters).

The engine runs :func:`check_optimizer_parameters` at ``make_private``,
:func:`trainable_changed` before every training forward, :func:`check_step_parameters` and a
:class:`StateWatch` at every step, before noise. Each refusal is a
:class:`~dpzoo.errors.PrivacyUsageError` with the fix.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import PrivacyUsageError
from ..grad_norms.hooks import NormHooks
from ..grad_norms.rounding import any_flag
from .model_walk import named_buffers, parameters

__all__ = ["check_optimizer_parameters", "check_step_parameters", "trainable_changed", "StateWatch"]


def check_optimizer_parameters(module: nn.Module, optimizer: torch.optim.Optimizer, trainable: set[int]) -> None:
    """The optimizer's trainable parameters must be exactly the model's (``trainable``: their
    ids): one outside the model would be updated with its raw gradient; one missing would spend
    ε on nothing."""
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    in_opt = {id(p): p for g in optimizer.param_groups for p in g["params"]}
    outside = [p for pid, p in in_opt.items() if pid not in names and p.requires_grad]
    if outside:
        shapes = ", ".join(str(tuple(p.shape)) for p in outside[:6])
        raise PrivacyUsageError(
            f"The optimizer holds {len(outside)} trainable parameter(s) that are not in the model (shapes "
            f"{shapes}): they would be updated with raw, unclipped gradients. Give the optimizer only "
            "model.parameters(); put every trained module (e.g. a head) inside the model passed to make_private."
        )
    missing = sorted({names[pid] for pid in trainable if pid not in in_opt})
    if missing:
        raise PrivacyUsageError(
            f"Trainable parameter(s) {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''} of the model are "
            "not in the optimizer: they would be clipped and noised but never trained. Pass model.parameters() "
            "to the optimizer, or freeze them (requires_grad_(False)) before make_private."
        )


def check_step_parameters(module: nn.Module, hooks: NormHooks, optimizer: torch.optim.Optimizer) -> None:
    """At each step: the optimizer still trains exactly the parameters ``hooks`` clip."""
    hooked = {id(p) for p in hooks.trainable_parameters.values() if p.requires_grad}
    in_opt = {id(p): p for g in optimizer.param_groups for p in g["params"] if p.requires_grad}
    extra = [p for pid, p in in_opt.items() if pid not in hooked]
    if extra:  # the model's names only for the message: walking the model every step costs host time
        names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        label = ", ".join(names.get(id(p), f"<not in the model, shape {tuple(p.shape)}>") for p in extra[:6])
        raise PrivacyUsageError(
            f"The optimizer now trains parameter(s) dpzoo does not clip: {label}. They would be updated with raw "
            "gradients. Add parameters to the model before make_private (a new engine), not to the optimizer."
        )
    missing = [n for n, p in hooks.trainable_parameters.items() if p.requires_grad and id(p) not in in_opt]
    if missing:
        raise PrivacyUsageError(
            f"Trainable parameter(s) {', '.join(missing[:8])} are not in the optimizer: unfrozen after make_private "
            "(the optimizer never held them: make the model private again with an optimizer over them) or removed "
            "from the optimizer (freeze them with requires_grad_(False) instead)."
        )


def trainable_changed(module: nn.Module, hooks: NormHooks, modules=None) -> bool:
    """True if parameters were frozen or unfrozen since ``hooks`` were planned (they must be
    planned again); refuses a forward in which the hooked parameters are not the model's own.
    ``modules``: :func:`.model_walk.named_modules` of ``module`` taken just before (else walked now)."""
    hooked = hooks.trainable_parameters
    params = parameters(module) if modules is None else parameters(module, modules)  # one walk for both checks
    present = {id(p) for p in params}
    swapped = [n for n, p in hooked.items() if id(p) not in present]
    if swapped:
        raise PrivacyUsageError(
            f"Parameter(s) {', '.join(swapped[:6])} are not in the model during this forward: they were swapped "
            "(torch.func.functional_call, stateless calls) or removed. dpzoo clips the model's own parameters: "
            "call the model itself."
        )
    # loops, not any(...): a generator is a frame per parameter, before every training forward
    ids = set()
    for p in hooked.values():
        if not p.requires_grad:
            return True
        ids.add(id(p))
    for p in params:
        if p.requires_grad and id(p) not in ids:
            return True
    return False


def _checksums(module: nn.Module) -> dict[str, tuple[float, float]]:
    """Two sums per parameter (plain and squared, float64): a cheap fingerprint of its values."""
    with torch.no_grad():
        return {n: (float(p.double().sum()), float(p.double().pow(2).sum())) for n, p in module.named_parameters()}


def _comparable(now: torch.Tensor, before: torch.Tensor) -> bool:
    """Same shape and dtype (a dtype change could carry data in the bits the values compare
    equal on) and a plain (strided, unquantized) layout; else the buffer counts as changed, or
    for a quantized one :func:`_differs` compares it whole."""
    return now.shape == before.shape and now.dtype == before.dtype and now.layout == before.layout


def _differs(now: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """A device bool: any value of ``now`` other than ``before``'s (NaN never equal to itself, and
    for floats the sign of zero too); a quantized buffer compared with its scale and zero point."""
    if now.is_quantized or before.is_quantized:
        return torch.tensor(not torch.equal(now, before))
    out = now != before
    if now.is_floating_point():
        out = out | (torch.signbit(now) != torch.signbit(before))
    return out.any()


class StateWatch:
    """Nothing computed from the batch may be stored outside the DP update: the model's buffers
    are compared by value (``.data`` writes move no version counter) from a step's first forward
    to the step, in any mode; every parameter by a checksum over the first step (a data-dependent
    initialisation, a renormalisation)."""

    def __init__(self, module: nn.Module):
        self.module = module
        self._buffers_at_step: dict | None = None
        self._param_sums: dict | None = None

    def start_forward(self, first_step: bool, modules=None) -> None:
        """Before a training forward: keep the buffers (at a step's first forward) and, on the
        first step (``first_step``), the parameters' checksums. ``modules`` as for :func:`trainable_changed`."""
        if self._buffers_at_step is None:
            now = named_buffers(self.module) if modules is None else named_buffers(self.module, modules)
            self._buffers_at_step = {n: b.detach().clone() for n, b in now.items()}
        if self._param_sums is None and first_step:
            self._param_sums = _checksums(self.module)

    def compare_buffers(self, when: str) -> None:
        """Refuse buffers changed since the step's first forward (``when`` names the interval)."""
        before = self._buffers_at_step
        if before is None:
            return
        now = named_buffers(self.module)
        changed = [n for n, b in before.items() if n not in now or not _comparable(now[n], b)]
        kept = [n for n in before if n not in changed]
        # compared on the device, one host read for all (on a GPU each read waits for the queue;
        # torch.equal read once per buffer)
        flags = [_differs(now[n].detach(), before[n]) for n in kept]
        if flags and any_flag(flags):
            changed += [n for n, f in zip(kept, flags) if bool(f)]
        changed += [n for n in now if n not in before]
        if changed:
            self._buffers_at_step = None
            raise PrivacyUsageError(
                f"Buffer(s) {', '.join(changed[:6])} changed during {when}: values computed from private data would be "
                "released without noise (and may mix samples). Stop what updates them (a running statistic, an EMA, "
                "a hook) or replace it (dpzoo.make_dp_ready converts BatchNorm)."
            )

    def check_step(self) -> None:
        """At each step, before noise: buffers unchanged since the step's first forward (backward
        hooks included); on the first step, every parameter unchanged since its first forward."""
        self.compare_buffers("this step (forward, backward or a hook)")
        self._buffers_at_step = None
        if self._param_sums is not None:
            now = _checksums(self.module)
            moved = [n for n, v in self._param_sums.items() if now.get(n) != v]
            self._param_sums = None
            if moved:
                raise PrivacyUsageError(
                    f"Parameter(s) {', '.join(moved[:6])} changed between the first forward pass and optimizer.step(): "
                    "something wrote batch data into them (a data-dependent initialisation, a renormalisation, a "
                    "write through .data), which would be released without noise. Initialise on public data before "
                    "make_private."
                )
