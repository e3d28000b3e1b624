"""The self-check: dpzoo's per-sample gradient norms on *this* model against single-sample
backward passes, for what layer shapes cannot reveal.

Hooks attribute row i of every hooked layer's input to sample i. That is exact when the model
is batch-first and processes samples independently, and shape checks catch most models that
are not. They cannot catch a model that runs a layer time-major with T == B, a (T, T) lookup
(T5's ``relative_attention_bias``) when T == B, samples permuted inside forward, a layer whose
computation differs from its registered rule (an overridden ``_conv_forward``, a replaced
``forward``). The self-check can: for a few samples i of a real batch it compares

* the model's output row i in the batch with the output of sample i run alone, and
* the hooks' per-parameter norms ‖∂L_i/∂θ‖ with those of an ordinary backward pass of
  sample i alone (plain autograd, no hooks),

with the same output gradients (the loss's gradient at the batch outputs, row i), in eval mode
(dropout off) so both passes compute the same function. Any disagreement raises
:class:`~dpzoo.SelfCheckError` naming the parameters. The engine runs it on the first logical
step, before any noisy update is released (``make_private(self_check=True)``, the default);
:func:`verify` runs it on any model.

The check reads a few samples of the private batch to decide whether to refuse; what it
decides depends on the model's structure, not on the values, and nothing it computes is
released.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import DPZooError, SelfCheckError
from ..grad_norms.hooks import NormHooks, attach_norm_hooks, attached_norm_hooks, output_tensors
from ..grad_norms.rounding import mechanism_dtype
from .padding_check import check_padding

__all__ = ["verify", "self_check", "SelfCheckReport"]

# Relative tolerance per parameter, with a floor of 0.1 of the sample's total gradient norm: a gap
# fails only if it is over `tol` of the parameter's norm and over 0.1·tol of the total. A layer
# whose rule does not fit is off by O(1); float32 roundoff alone reached ~1% on a parameter whose
# gradient is a tiny sum of cancelling terms (a first conv: 8e-5, ghost norm vs a single conv),
# which is far below 1e-3 of the total that clipping uses.
_FLOOR = 0.1
_TOL = {torch.float64: 1e-6, torch.float32: 1e-2, torch.bfloat16: 1e-1, torch.float16: 1e-1}


@dataclass
class SelfCheckReport:
    """What the self-check compared: the samples, and per parameter the largest relative gap."""

    samples: list[int]
    batch_size: int
    worst: dict[str, float] = field(default_factory=dict)  # name -> max relative norm difference
    tolerance: float = 0.0

    def __str__(self) -> str:
        top = max(self.worst.values(), default=0.0)
        return (
            f"self-check passed: samples {self.samples} of a batch of {self.batch_size}, "
            f"{len(self.worst)} parameters, largest relative difference {top:.2e} (tolerance {self.tolerance:.0e})"
        )


def _slice_row(obj, i: int, batch: int):
    """Sample i of a batch-first input: tensors whose first dimension is the batch are sliced."""
    if isinstance(obj, torch.Tensor):
        return obj[i : i + 1] if obj.dim() > 0 and obj.shape[0] == batch else obj
    if isinstance(obj, dict):
        return {k: _slice_row(v, i, batch) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_slice_row(v, i, batch) for v in obj)
    return obj


def _pick(batch: int, samples: int) -> list[int]:
    """Spread over the batch: first, last, middle, then evenly (an offset or a permutation of
    the rows shows at the ends and the middle)."""
    if batch <= samples:
        return list(range(batch))
    picks = [0, batch - 1, batch // 2] + [(k * batch) // (samples + 1) for k in range(3, samples)]
    return sorted(dict.fromkeys(picks))[:samples]


def _modes(model: nn.Module) -> dict[nn.Module, bool]:
    return {m: m.training for m in model.modules()}


def self_check(
    model: nn.Module,
    hooks: NormHooks,
    args: tuple,
    kwargs: dict,
    cotangents: list[torch.Tensor] | None = None,
    loss_fn=None,
    samples: int = 3,
    loader=None,
) -> SelfCheckReport:
    """Compare ``hooks``' per-sample norms on the batch ``(args, kwargs)`` with single-sample
    backward passes (see the module docstring). Output gradients: ``cotangents`` (one per output
    tensor, in :func:`~dpzoo.grad_norms.hooks.output_tensors` order) or those of
    ``loss_fn(output)`` on the batch. ``loader``: the engine's data loader, whose first batch's
    samples are also collated alone (:mod:`.padding_check`). Leaves ``hooks`` with no records, the
    model in its modes."""
    modes = _modes(model)
    params = hooks.trainable_parameters
    hooks.clear()
    try:
        model.eval()  # dropout off: the batch and the single samples compute the same function
        outs, cotangents, batch, extras = _batch_outputs(model, args, kwargs, cotangents, loss_fn)
        hooks.backward_from(outs, cotangents)
        sq = hooks.per_param_sq_norms()
        hooks_norms = {n: v.detach().sqrt().double() for n, v in sq.items()}
        # the step clips by per_sample_norms (own path): the same sums up to float32 bounds' allowances (≤4·2⁻¹²⁶ each)
        total, expected = hooks.per_sample_norms().double(), torch.stack(list(sq.values())).double().sum(0)
        slack = 5 * (sum(p.numel() for p in params.values()) + len(sq)) * 2.0**-126
        if ((total.square() - expected).abs() > 1e-4 * expected + slack).any():
            raise SelfCheckError(f"dpzoo's total per-sample norms {total.tolist()[:4]} disagree with its per-parameter "
                                 f"ones {expected.sqrt().tolist()[:4]}: a bug in dpzoo (please report it); no step is taken.")  # fmt: skip
        # random per-row weights (not all ones): a per-sample gradient given to the wrong row changes
        # the weighted sum even when the rows the norm check compares are left in place
        gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(7), "little"))
        weights = torch.randn(batch, generator=gen, dtype=torch.float64).to(outs[0].device)
        summed = {n: g.detach().double() for n, g in hooks.clipped_sum(weights.to(outs[0].dtype)).items()}
        hooks_sum_ones = (
            hooks.clipped_sum(torch.ones(batch, dtype=outs[0].dtype, device=outs[0].device))
            if loss_fn is not None
            else {}
        )
        batch_outs = [o.detach() for o in outs]
        hooks.clear()
        picks = _pick(batch, samples)
        tol = max(_TOL.get(p.dtype, 1e-2) for p in params.values())
        names = list(params)
        worst = {n: 0.0 for n in names}
        mixing: list[str] = []
        bad: dict[str, list[tuple[int, float, float]]] = {}  # name -> (sample, hooks norm, norm alone)
        with hooks.paused():
            # The sum of the per-sample gradients must be the batch gradient (plain autograd):
            # a layer whose gradient reaches the wrong tensor keeps its norms but not its sum.
            sums = (summed, hooks_sum_ones, weights)
            wrong_sum = _sum_check(model, args, kwargs, cotangents, loss_fn, params, sums, tol, worst)
            for i in picks:
                _check_alone(model, args, kwargs, i, (outs, batch_outs, cotangents, extras), params, hooks_norms, tol,
                             worst, mixing, bad)  # fmt: skip
            if loader is not None and not mixing:
                check_padding(model, loader, args, kwargs, batch_outs, cotangents, tol)
    finally:
        hooks.clear()
        for m, training in modes.items():
            m.training = training
    if not mixing and any(modes.values()):
        mixing = _train_mode_mixing(model, hooks, args, kwargs, batch, picks[0], tol)
    _refuse(mixing, wrong_sum, bad)
    return SelfCheckReport(picks, batch, worst, tol)


def _batch_outputs(model, args, kwargs, cotangents, loss_fn):
    """(outputs, their gradients, batch size) of the self-check's forward pass on the batch, refused
    where per-sample clipping cannot mean anything (no output, not batch-first, NaN)."""
    out = model(*args, **kwargs)
    outs = output_tensors(out)
    if not outs:
        raise SelfCheckError("The self-check found no output tensor with a gradient path in the model's output.")
    batch = outs[0].shape[0] if outs[0].dim() else 0
    if cotangents is None:
        if loss_fn is None:
            raise DPZooError("self_check needs the output gradients or a loss_fn.")
        loss = loss_fn(out)
        cotangents = list(torch.autograd.grad(loss, outs, allow_unused=True, retain_graph=True))
        cotangents = [torch.zeros_like(o) if c is None else c.detach() for o, c in zip(outs, cotangents)]
    if len(cotangents) != len(outs) or any(c.shape != o.shape for c, o in zip(cotangents, outs)):
        raise SelfCheckError(
            "The model's outputs changed structure between the training pass and the "
            "self-check's (in eval mode): the self-check cannot compare them."
        )
    for o in outs:
        if o.dim() == 0 or o.shape[0] != batch:
            raise SelfCheckError(
                f"The model returns an output of shape {tuple(o.shape)} beside one of {batch} rows: every output "
                "must be batch-first (row i = sample i) for per-sample clipping to mean anything."
            )
    if batch < 1:
        raise SelfCheckError("The self-check needs a batch with at least one sample.")
    nan_rows = sorted(
        {int(i) for o in outs if o.is_floating_point() for i in torch.isnan(o).reshape(batch, -1).any(1).nonzero()}
    )
    if nan_rows:
        raise SelfCheckError(
            f"The self-check's own forward pass (eval mode, no autocast) gives NaN for sample(s) {nan_rows[:8]} of the "
            "first batch: NaN or inf in the data or the model, not a float16 overflow. Clean the data."
        )
    return outs, cotangents, batch, _without_gradient(out, batch)


def _without_gradient(out, batch: int) -> list:
    """The batch-first floating outputs without gradient (predictions, scores): row i must be
    sample i's as well, since the loss may read them (tracked as each sample's rows)."""
    every = output_tensors(out, grad_only=False)
    return [
        o.detach() for o in every if o.grad_fn is None and o.dim() and o.shape[0] == batch and o.is_floating_point()
    ]


def _sum_check(model, args, kwargs, cotangents, loss_fn, params, sums, tol, worst) -> list[str]:
    """The parameters whose weighted sum of per-sample gradients (``sums``: dpzoo's weighted and
    unweighted sums, the row weights) is not the batch gradient of plain autograd."""
    summed, hooks_sum_ones, weights = sums
    names, tensors = list(params), list(params.values())
    out_b = model(*args, **kwargs)
    outs_b = output_tensors(out_b)

    def _row_weighted(c, o):
        # in the outputs' precision, as dpzoo's weighted sum: a bf16-autocast step's cotangents
        # weighted in bf16 moved a sum of cancelling rows by ~1% (a false refusal, 1 step in 20)
        w = weights.to(o.dtype).reshape(-1, *([1] * (c.dim() - 1)))
        return c.to(o.dtype) * w

    ref_grads = torch.autograd.grad(
        outs_b,
        tensors,
        [_row_weighted(c, o) for c, o in zip(cotangents, outs_b)],
        allow_unused=True,
        retain_graph=loss_fn is not None,
    )
    ref_sum = {
        n: (g.detach().double() if g is not None else torch.zeros_like(summed[n])) for n, g in zip(names, ref_grads)
    }
    if loss_fn is not None:
        # a use of a parameter in the loss itself (outside the model) is in the loss's batch
        # gradient but not in any output gradient: the unweighted sums must agree too
        ones = {n: g.detach().double() for n, g in hooks_sum_ones.items()}
        ref_loss = torch.autograd.grad(loss_fn(out_b), tensors, allow_unused=True)
        for n, g in zip(names, ref_loss):
            g = g.detach().double() if g is not None else torch.zeros_like(ones[n])
            if (ones[n] - g).norm().item() > tol * max(g.norm().item(), 1e-30) + 1e-12:
                ref_sum[n] = ref_sum[n] + float("inf")  # reported below as a wrong sum
    scale = float(sum(float(v.pow(2).sum()) for v in ref_sum.values() if torch.isfinite(v).all())) ** 0.5
    wrong_sum = []
    for n in names:
        gap = (summed[n] - ref_sum[n]).norm().item()
        rel = gap / max(ref_sum[n].norm().item(), _FLOOR * scale, 1e-30) if math.isfinite(gap) else math.inf
        worst[n] = max(worst[n], rel)
        if rel > tol:
            wrong_sum.append(f"{n} (relative difference {rel:.2g})")
    return wrong_sum


def _check_alone(model, args, kwargs, i, batch_run, params, hooks_norms, tol, worst, mixing, bad) -> None:
    """Sample ``i`` alone: its output must be its row of the batch's (else ``mixing``), and its
    gradient norms dpzoo's (else ``bad``)."""
    outs, batch_outs, cotangents, extras = batch_run
    batch = outs[0].shape[0]
    names, tensors = list(params), list(params.values())
    out_i = _alone(model, _slice_row(args, i, batch), _slice_row(kwargs, i, batch))
    outs_i = output_tensors(out_i)
    extras_i = _without_gradient(out_i, 1)
    batch_outs = batch_outs + extras if len(extras_i) == len(extras) else batch_outs
    if len(outs_i) != len(outs) or any(a.shape[1:] != b.shape[1:] or a.shape[0] != 1 for a, b in zip(outs_i, outs)):
        mixing.append(
            f"sample {i}: output shapes {[tuple(a.shape) for a in outs_i]} alone vs "
            f"{[tuple(b.shape[1:]) for b in outs]} per row in the batch"
        )
        return
    for a, b in zip(outs_i + (extras_i if len(extras_i) == len(extras) else []), batch_outs):
        gap = (a.detach()[0] - b[i]).abs().max().item()
        scale = b[i].abs().max().item() + 1e-30
        if gap > tol * max(scale, 1e-3):
            mixing.append(
                f"sample {i}: its output row in the batch differs from its output alone (max difference {gap:.3g})"
            )
            break
    grads = torch.autograd.grad(outs_i, tensors, [c[i : i + 1] for c in cotangents], allow_unused=True)
    zero = torch.zeros((), dtype=torch.float64)
    ref = {n: g.detach().double().norm() if g is not None else zero for n, g in zip(names, grads)}
    total = torch.sqrt(sum(v**2 for v in ref.values())).item()
    for n in names:  # beyond the absolute allowance of a float32 bound (a gradient that underflows: ~1e-16)
        got, want, tiny = hooks_norms[n][i].item(), ref[n].item(), torch.finfo(mechanism_dtype(params[n].dtype)).tiny
        slack = math.sqrt(5 * (params[n].numel() + 2**20) * tiny)
        rel = max(abs(got - want) - slack, 0.0) / max(want, got, _FLOOR * total, 1e-30)
        worst[n] = max(worst[n], rel)
        if rel > tol:
            bad.setdefault(n, []).append((i, got, want))


def _refuse(mixing: list, wrong_sum: list, bad: dict) -> None:
    """What the self-check found, as one SelfCheckError (the first kind that failed)."""
    if mixing:
        raise SelfCheckError(
            "Self-check failed: the model does not process batch rows independently ("
            + "; ".join(mixing[:3])
            + "). dpzoo clips row i of dimension 0 as sample i: make the model batch-first, with no mixing, "
            "permutation or randomness that eval() leaves on; or pass self_check=False if you have checked this "
            "yourself (recorded in the privacy metadata)."
        )
    if wrong_sum:
        raise SelfCheckError(
            "Self-check failed: the sum of dpzoo's per-sample gradients is not the batch gradient for "
            f"{', '.join(wrong_sum[:6])}: a parameter is used where its layer's rule cannot see it (swapped "
            "parameters, an edited output, a use in the loss), or a layer runs on time-major inputs (T, B, ...) with "
            "T = B. Route every use through the layer's own forward; make such layers batch-first."
        )
    if bad:
        shown = "; ".join(
            f"{n}: sample {i} hooks {g:.4g} vs alone {w:.4g}" for n, v in list(bad.items())[:6] for i, g, w in v[:1]
        )
        raise SelfCheckError(
            f"Self-check failed: dpzoo's per-sample gradient norms disagree with single-sample backward passes for "
            f"{len(bad)} parameter(s) ({shown}). A layer computes something other than its registered rule assumes "
            "(an overridden forward or _conv_forward, a time-major or (T, T)-indexed layer, a custom op): replace "
            "it, freeze it, or register a rule for it with dpzoo.grad_norms.register_rule."
        )


def _alone(model: nn.Module, args, kwargs):
    """The model on one sample; a failure there (a layer needing more than one sample) is refused."""
    try:
        return model(*args, **kwargs)
    except (RuntimeError, ValueError) as e:
        raise SelfCheckError(
            f"The model fails on one sample alone ({str(e).splitlines()[0][:160]}): a layer that computes statistics "
            "over the batch (training-mode batch norm, F.batch_norm(training=True)) mixes samples. Use GroupNorm or "
            "LayerNorm (dpzoo.make_dp_ready converts BatchNorm)."
        ) from None


def _train_mode_mixing(model: nn.Module, hooks: NormHooks, args, kwargs, batch: int, j: int, tol: float) -> list[str]:
    """Mixing that only happens in train mode (batch statistics, mixup, in-batch shuffles): run
    the batch twice in train mode with the same random state, the second time with sample j
    replaced by another; every other row's output must stay the same. Buffers are restored."""
    if batch < 2:
        return []
    k = (j + 1) % batch

    def replaced(obj):
        if isinstance(obj, torch.Tensor):
            if obj.dim() > 0 and obj.shape[0] == batch:
                obj = obj.clone()
                obj[j] = obj[k]
            return obj
        if isinstance(obj, dict):
            return {key: replaced(v) for key, v in obj.items()}
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            return type(obj)(replaced(v) for v in obj)
        return obj

    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    devices = sorted({t.device.index for t in model.parameters() if t.device.type == "cuda"})
    seed = int.from_bytes(os.urandom(7), "little")  # not from torch's RNG: the user's stream stays untouched
    outs = []
    try:
        with hooks.paused(), torch.no_grad():
            for inputs in ((args, kwargs), (replaced(args), replaced(kwargs))):
                with torch.random.fork_rng(devices=devices):
                    torch.manual_seed(seed)
                    outs.append([o.detach() for o in output_tensors(model(*inputs[0], **inputs[1]), grad_only=False)])
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
    keep = torch.ones(batch, dtype=torch.bool)
    keep[j] = False
    for a, b in zip(*outs):
        if a.dim() == 0 or a.shape[0] != batch or a.shape != b.shape:
            continue
        gap = (a[keep] - b[keep]).abs().max().item() if keep.any() else 0.0
        if gap > tol * max(a[keep].abs().max().item(), 1e-3):
            return [f"in train mode, changing sample {j} changed other samples' outputs (max difference {gap:.3g})"]
    return []


def verify(model: nn.Module, inputs, loss_fn, *, samples: int = 3, mode: str = "auto") -> SelfCheckReport:
    """Check dpzoo's per-sample gradient norms on ``model`` against single-sample backward passes.

    ``inputs``: a tensor, a tuple of positional arguments or a dict of keyword arguments for
    ``model``; ``loss_fn(output)``: the per-sample losses summed (capture labels in a closure).
    Raises :class:`~dpzoo.SelfCheckError` (or :class:`~dpzoo.UnsupportedModuleError` when the
    hooks refuse the model outright); returns a :class:`SelfCheckReport` otherwise. Uses the
    hooks already attached to ``model`` (e.g. by the engine), else attaches its own for the check.
    """
    if isinstance(inputs, dict):
        args, kwargs = (), dict(inputs)
    elif isinstance(inputs, tuple):
        args, kwargs = inputs, {}
    else:
        args, kwargs = (inputs,), {}
    hooks = attached_norm_hooks(model)
    own = hooks is None
    if own:
        hooks = attach_norm_hooks(model, mode, ghost_backward=True)
    try:
        with torch.enable_grad():
            return self_check(model, hooks, args, kwargs, loss_fn=loss_fn, samples=samples)
    finally:
        if own:
            hooks.detach()
