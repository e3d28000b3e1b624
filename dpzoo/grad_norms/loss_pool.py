"""What the backward of a watched loss tells the engine: the loss is pooled over samples (a sum or a
mean), it holds every sample once, and its reduction is the one the engine scales by.

The engine turns the gradients its hooks see into each sample's gradient by the row count b of
the batch (``loss_reduction="mean"``: the loss is (1/b)·Σ_i ℓ_i) or by 1 (``"sum"``). A loss
reduced the other way weighs every sample's clipped gradient by b, which a neighbouring batch
changes for all of them: the released sum moves by up to about 2R. Python numbers that scale the
loss are constants to dpzoo: one computed from the batch (``len(y)``) is not seen. :func:`before_gradient` runs before autograd (from
:meth:`~.sample_rows.SampleRows.__torch_function__`), refuses what the engine cannot scale and
leaves a record that :func:`check_reduction` compares with the engine's ``loss_reduction``.
"""

from __future__ import annotations

import contextlib

import torch

from ..errors import LossMixingError, PrivacyUsageError
from .row_rules import FIX, refuse

__all__ = [
    "before_gradient",
    "take_record",
    "check_reduction",
    "unwatched",
    "watched_backward",
    "check_watched",
    "grad_call",
]

RECORD: dict = {}  # the last watched loss's reduction over samples and its Python factors
INTERNAL: list = []  # non-empty while dpzoo itself back-propagates given output gradients


@contextlib.contextmanager
def unwatched():
    """dpzoo's own backward from output gradients (the self-check's vector-Jacobian products)."""
    INTERNAL.append(True)
    try:
        yield
    finally:
        INTERNAL.pop()


WATCHED: list = []  # non-empty while autograd runs a backward dpzoo saw start (of a watched loss)


@contextlib.contextmanager
def watched_backward():
    """Around ``backward`` / ``autograd.grad`` of a watched tensor (after :func:`before_gradient`)."""
    WATCHED.append(True)
    try:
        yield
    finally:
        WATCHED.pop()


def check_watched(tagged: list, grads) -> None:
    """Gradient reaching the model's tracked outputs in a backward dpzoo did not see start: the loss
    was computed from them where dpzoo cannot follow (TorchScript, ``torch.func`` transforms, a
    C++ extension), so how it weighs each sample is unknown."""
    if WATCHED or INTERNAL:
        return
    if any(t and g is not None and bool(g.ne(0).any()) for t, g in zip(tagged, grads)):
        raise LossMixingError(
            "the loss reached backward() without dpzoo seeing how it was computed from the model's outputs "
            "(TorchScript, torch.func, a C++ extension), so how it weighs each sample cannot be checked (false "
            f"ε possible): compute it with torch operations on the outputs, {FIX}."
        )


def grad_call(args, kwargs) -> tuple[list, list, object]:
    """``torch.autograd.grad``'s (outputs, inputs, grad_outputs), the first two as lists."""
    outputs = args[0] if args else kwargs.get("outputs", ())
    inputs = args[1] if len(args) > 1 else kwargs.get("inputs", ())
    listed = [[t] if isinstance(t, torch.Tensor) else list(t) for t in (outputs, inputs)]
    return listed[0], listed[1], kwargs.get("grad_outputs", args[2] if len(args) > 2 else None)


def before_gradient(func, args, kwargs) -> None:
    """``register_hook`` on a watched tensor, or ``backward`` of one (``loss.backward(gradient)``,
    ``torch.autograd.backward(tensors, grad_tensors)``): refuse or record."""
    if INTERNAL:
        return
    if func is torch.autograd.grad:
        outputs, inputs, _ = grad_call(args, kwargs)
        if all(getattr(getattr(o, "rows", None), "foreign", False) for o in outputs):
            return  # another model's loss on the batch (a reference, a copy): not the private update
        if any(isinstance(t, torch.nn.Parameter) for t in inputs):
            raise PrivacyUsageError(
                "torch.autograd.grad of a private step's loss with respect to parameters: dpzoo forms no batch "
                "gradient of the parameters (its hooks take each sample's from the layers), and one would not be "
                "clipped per sample. Losses that need it (a gradient-norm penalty, SAM's ascent step) are not "
                "supported: call loss.backward() and optimizer.step()."
            )
        return
    if getattr(func, "__name__", "") == "register_hook":
        if getattr(args[0], "rows", None) is not None and args[0].requires_grad and not args[0].rows.foreign:
            raise LossMixingError(
                "register_hook on the model's outputs (or on what derives from them) rewrites each sample's "
                f"gradient where dpzoo cannot see it (false ε); put the computation in the loss: {FIX}."
            )
        return
    if func is torch.Tensor.backward:
        tensors, grads = [args[0]], [kwargs.get("gradient", args[1] if len(args) > 1 else None)]
    else:
        tensors = args[0] if args else kwargs.get("tensors")
        grads = kwargs.get("grad_tensors", args[1] if len(args) > 1 else None)
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        grads = [grads] * len(tensors) if grads is None or isinstance(grads, torch.Tensor) else list(grads)
    reductions = set()
    for t, g in zip(tensors, grads):
        if getattr(t, "rows", None) is not None and t.requires_grad and not t.rows.foreign:
            note_loss(t, g)  # (another model's loss on the batch is not the private update)
            reductions.add(RECORD["reduction"])
    if len(reductions - {None}) > 1:  # autograd.backward([a.mean(), b.sum()]): one record for the step
        refuse("backward() of a mean over samples together with a sum over samples")


def user_function(loss: torch.Tensor, limit: int = 100_000) -> str | None:
    """The name of a user's ``torch.autograd.Function`` in the loss's graph after the model (its
    backward may rewrite each sample's gradient, ``g - g.mean(0)``, where dpzoo cannot see it), or
    None. The walk stops at dpzoo's own functions (the model's outputs are cut from the model's
    graph there); torch's own (DDP, checkpointing) are known."""
    seen: set = set()
    stack = [loss.grad_fn]
    while stack and len(seen) < limit:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        owner = getattr(node, "_forward_cls", None)
        if owner is not None and owner.__module__.startswith("dpzoo."):
            continue
        if owner is not None and not owner.__module__.startswith("torch."):
            return owner.__name__
        stack.extend(f for f, _ in node.next_functions)
    return None


def note_loss(t, gradient) -> None:
    if (name := user_function(t)) is not None:
        refuse(
            f"{name}, a custom autograd.Function in the loss (dpzoo cannot see what its backward does to each "
            "sample's gradient; apply it inside the model, where the first step is checked)"
        )
    state = t.rows
    if not state.pooled and state.row is not None:  # one sample's values: a loss of that row alone
        state = state._replace(pooled=True, reduction="sum", covered=frozenset([state.row]))
    if not state.pooled:
        refuse("backward() of per-sample values rather than of a loss pooled over samples")
    factor = 1.0
    if gradient is not None:
        if getattr(gradient, "rows", None) is not None or (isinstance(gradient, torch.Tensor) and gradient.numel() > 1):
            refuse("backward(gradient=...) weighing the loss by values of the batch")
        factor = float(gradient)
    if state.covered is not None:
        start, stop = state.call or (0, state.samples)
        if state.covered != frozenset(range(start, stop)):
            refuse(f"a loss holding {len(state.covered)} of the batch's {stop - start} samples (a loop over some rows)")
    RECORD.clear()
    RECORD.update(reduction=state.reduction, scalars=(*state.scalars, factor))


def take_record() -> dict | None:
    """The record of the last watched backward, once (None when the loss was not watched)."""
    if not RECORD:
        return None
    record = dict(RECORD)
    RECORD.clear()
    return record


def check_reduction(record: dict | None, loss_reduction: str, rows: int) -> None:
    """Refuse a watched loss reduced over samples otherwise than the engine's ``loss_reduction``.
    Python numbers are constants here (what they were computed from is not seen): a mean written
    as ``.sum() / len(y)`` is a sum to dpzoo, refused under ``"mean"`` (write ``.mean()``)."""
    if record is None or rows < 2:
        return  # not watched; or one row, where a sum and a mean agree
    if record["reduction"] is not None and record["reduction"] != loss_reduction:
        other = "sum" if loss_reduction == "mean" else "mean"
        raise LossMixingError(
            f"the loss is a {record['reduction']} over the batch's samples, but make_private was given "
            f"loss_reduction={loss_reduction!r}: each sample's clipped gradient would be scaled by the batch's size "
            f"(false ε). Pass loss_reduction={other!r}, or reduce the loss with .{loss_reduction}() "
            "(not .sum() / len(batch), which dpzoo sees as a sum scaled by a constant)."
        )
