"""Which operations keep a DP step's samples apart: the rules :class:`~.sample_rows.SampleRows`
applies to each operation on the batch, the model's outputs and what derives from them.

Default-deny for what carries gradient into the update. An operation on tracked tensors that
require grad is accepted when it is known to act on each sample separately — elementwise, along
other dimensions, batch-first (convolutions, normalisations of one sample, losses whose rows are
the samples), a product that keeps the samples apart — or to be linear over samples (a sum or a
mean: the pool, after which only linear operations by constants may follow). Anything else that
touches the sample dimension, combines two tensors whose rows are not the same samples in the
same order, or uses a statistic of the batch computed without gradient (``x.detach().mean()``,
``mask.sum()``) is refused (:func:`refuse`). An unknown operation on rows that lead (dimension 0)
and keeps them is taken as batch-first, as torch's operations are. Without gradient (the batch
before the model, labels, metrics) nothing is refused: the state says whether the rows are still
the samples in order (``aligned``), a single sample's values (``row``) or a statistic (``stat``).
"""

from __future__ import annotations

import math
from typing import NamedTuple, NoReturn

import torch

from ..errors import LossMixingError, UnsupportedModuleError
from .row_ops import (
    ADDITIVE,
    ALONG,
    DIVIDE,
    ELEMENTWISE,
    INDEXED_WRITES,
    LOSSES,
    MEAN_LOSSES,
    PRODUCTS,
    SCALING,
    VIEWS,
    absolute_row,
    across,
    leaves,
    picked_row,
    pointwise,
    result_dim,
    sliced,
    window_of,
)

__all__ = ["State", "grad_state", "nograd_state", "refuse"]

FIX = "compute each sample's loss (reduction='none'), then sum or average over samples, or use dpzoo.losses"


class State(NamedTuple):
    """What a tracked tensor's values are, with respect to the step's samples."""

    samples: int
    sample_dim: int | None = 0  # where the samples are; None: a single row, a statistic, or lost
    pooled: bool = False  # a sum over samples (with gradient): only linear operations may follow
    selected: bool = False  # rows picked by a boolean mask: a mean over them divides by a count
    aligned: bool = True  # row i is still sample i (no roll, permutation, subset by index)
    owned: frozenset | None = None  # outputs: ids of the model's trainable parameters
    stat: bool = False  # computed across samples without gradient (a detached batch statistic)
    row: int | None = None  # the values of one sample (its index in the batch)
    window: tuple | None = None  # rows [start, stop) of the batch (a slice, a micro-batch); None: all
    call: tuple | None = None  # the model's outputs: the rows [start, stop) of the call they came from
    reduction: str | None = None  # a pooled loss: "mean" or "sum" over the samples
    scalars: tuple = ()  # Python numbers a pooled loss was multiplied by after pooling (1/d for a division)
    covered: frozenset | None = None  # a sum of single samples' values: their rows (None: all rows)
    written: bool = False  # values written in place by position (w[:2] = 1): weights by position
    foreign: bool = False  # with gradient from parameters outside the private model only (another model's)


def refuse(what: str) -> NoReturn:
    raise LossMixingError(
        f"{what} mixes samples: each one's clipped gradient would depend on the others (false ε); {FIX}."
    )


# -- without gradient: follow, never refuse ------------------------------------------------------


def nograd_state(name: str, args, kwargs, tracked: list, out: torch.Tensor) -> State:
    """The state of a result without gradient: rows still aligned, one sample's values, or a
    statistic of the batch (any operation across samples)."""
    first = tracked[0].rows
    base = State(first.samples, owned=first.owned, written=any(t.rows.written for t in tracked))
    if any(t.rows.stat or t.rows.pooled for t in tracked):
        return base._replace(sample_dim=None, stat=True)
    rows = [t for t in tracked if t.rows.sample_dim is not None]
    if not rows:
        same = len({t.rows.row for t in tracked}) == 1 and first.row is not None
        return base._replace(sample_dim=None, row=first.row) if same else base._replace(sample_dim=None, stat=True)
    lead = rows[0]
    if looked_up(name, args, kwargs, lead):  # a constant table read at each sample's own index: alpha[y]
        return base._replace(sample_dim=0, aligned=lead.rows.aligned, window=lead.rows.window)
    aligned = all(t.rows.aligned for t in rows) and len({t.rows.aligned for t in tracked}) == 1
    kind = across(name, args, kwargs, lead, out)
    if kind == "row":
        return base._replace(sample_dim=None, row=absolute_row(lead, picked_row(name, args, kwargs)))
    if kind in ("pool", "mix") or len(rows) < len(tracked) or len({window_of(t) for t in rows}) > 1:
        return base._replace(sample_dim=None, stat=True)
    dim = (
        0
        if kind in ("select", "window", "reorder", "split") and out.dim()
        else result_dim(name, args, kwargs, lead, out)
    )
    if dim is None:
        return base._replace(sample_dim=None, stat=True)
    window = sliced(name, args, kwargs, lead) if kind == "window" else lead.rows.window
    return base._replace(sample_dim=dim, selected=kind == "select" or lead.rows.selected,
                         aligned=aligned and kind != "reorder", window=window)  # fmt: skip


# -- with gradient: accept what keeps samples apart, refuse the rest -----------------------------


def grad_state(name: str, args, kwargs, tracked: list, out: torch.Tensor) -> State:
    """The state of a result that carries gradient into the update; refuses what mixes samples."""
    first = tracked[0].rows
    base = State(first.samples, owned=first.owned, call=first.call)
    check_outside(name, args, kwargs, first.owned)
    if any(t.rows.foreign and t.requires_grad for t in tracked):
        raise UnsupportedModuleError(
            f"{name}: the output of a trainable module outside the private model (a head, a teacher with gradient) "
            "meets its outputs: that module's gradient would not be clipped per sample. Make it part of the model "
            "before make_private, or detach its output."
        )
    stats = [t for t in tracked if t.rows.stat]
    others = [t for t in tracked if not t.rows.stat]
    if stats and name in ADDITIVE and others and all(t.rows.pooled for t in others):
        return merge_pooled(name, args, others, [], base)  # the batch loss plus a constant: same gradient
    if stats:
        refuse(f"{name}: a statistic of the batch computed without gradient (detached, under no_grad) in the loss")
    pooled = [t for t in tracked if t.rows.pooled]
    rows = [t for t in tracked if not t.rows.pooled and t.rows.sample_dim is not None]
    singles = [t for t in tracked if not t.rows.pooled and t.rows.sample_dim is None and not t.rows.stat]
    if pooled:
        if rows:
            refuse(f"{name}: a sum over samples combined with per-sample rows")
        return merge_pooled(name, args, pooled, singles, base)
    if singles and not rows:
        return single_rows(name, args, singles, base)
    if singles:
        refuse(f"{name}: one sample's values combined with the batch's rows")
    return batch_rows(name, args, kwargs, rows, out, base)


def single_rows(name: str, args, singles: list, base: State) -> State:
    """Values of single samples (``out[i]``, a per-sample loop): any function of one sample is
    per-sample; values of different samples may only be added (a sum over samples)."""
    if len({t.rows.row for t in singles}) == 1 and singles[0].rows.row is not None:
        return base._replace(sample_dim=None, row=singles[0].rows.row)
    if name in ADDITIVE:
        return merge_pooled(name, args, [], singles, base)
    refuse(f"{name} of different samples' values (not a sum)")


def batch_rows(name: str, args, kwargs, rows: list, out, base: State) -> State:
    """Tensors whose rows are the samples: one of them, or several meeting in one operation."""
    lead = rows[0]
    if len(rows) > 1:
        check_meeting(name, args, kwargs, rows)
    if name in MEAN_LOSSES:
        check_mean_loss(name, args, kwargs, lead)
    check_positional(name, args, kwargs, lead)
    if name in LOSSES:
        if any(t.rows.sample_dim != loss_sample_dim(name, args, t) for t in rows) or not all(
            t.rows.aligned for t in rows
        ):
            refuse(f"{name} on rows that are not the samples in order")
        if out.dim() == 0:
            if kwargs.get("reduction", "mean") != "sum" and any(t.rows.selected for t in rows):
                refuse(f"{name} averaging rows selected by a mask (its divisor is a count of the batch)")
            return pooled_rows(name, rows, "sum" if kwargs.get("reduction") == "sum" else "mean", base)
        return base._replace(sample_dim=0, window=lead.rows.window)
    kind = across(name, args, kwargs, lead, out)
    if kind == "pool":
        if name in ("mean", "nanmean") and lead.rows.selected:
            refuse("the mean of rows selected by a mask (its divisor is a count of the batch)")
        return pooled_rows(name, rows, "mean" if name == "mean" else "sum", base)
    if kind == "mix":
        refuse(f"{name} across the sample dimension")
    if kind == "select" and not from_batch(args[1] if len(args) > 1 else None):
        refuse(f"{name}: rows picked by a mask that does not come from the batch (by position)")
    if kind == "row":
        return base._replace(sample_dim=None, row=absolute_row(lead, picked_row(name, args, kwargs)))
    dim = (
        0
        if kind in ("select", "window", "reorder", "split") and out.dim()
        else result_dim(name, args, kwargs, lead, out)
    )
    if dim is None:
        refuse(f"{name}: dpzoo cannot tell where the samples are after it")
    aligned = all(t.rows.aligned for t in rows) and kind != "reorder"
    window = sliced(name, args, kwargs, lead) if kind == "window" else lead.rows.window
    return base._replace(
        sample_dim=dim, selected=kind == "select" or lead.rows.selected, aligned=aligned, window=window
    )


def looked_up(name: str, args, kwargs, lead) -> bool:
    """``table[index]`` / ``table.gather(0, index)`` of an untracked table at a tracked index whose
    samples lead: row i of the result is the table's entry for sample i."""
    if not args or getattr(args[0], "rows", None) is not None or lead.rows.sample_dim != 0:
        return False
    if name == "__getitem__":
        return len(args) > 1 and args[1] is lead
    if name == "gather":
        return kwargs.get("index", args[2] if len(args) > 2 else None) is lead and lead.dim() == args[0].dim()
    return False


def pooled_rows(name: str, rows: list, reduction: str, base: State) -> State:
    """The batch's rows pooled into the loss, a sum or a mean over samples. Each sample must enter
    once whatever its position: a sum over a slice of the model's output rows holds those rows
    (checked to add up to the batch at backward, :mod:`.loss_pool`); a reordering, or a mean over
    a slice (its divisor is the slice's length, not the batch's), weighs samples by position."""
    lead = rows[0]
    covered = None
    if lead.rows.call is not None and window_of(lead) != lead.rows.call:
        if reduction == "mean":
            refuse(f"{name}: a mean over a slice of the model's output rows (out[:k]: its divisor is not the batch's)")
        covered = frozenset(range(*window_of(lead)))
    if lead.rows.call is not None and not all(t.rows.aligned for t in rows):
        refuse(f"{name} over a reordering of the model's output rows (out[::2], out[perm]: a weight by position)")
    return base._replace(sample_dim=None, pooled=True, reduction=reduction, covered=covered)


def merge_pooled(name: str, args, pooled: list, singles: list, base: State) -> State:
    """A pooled loss after ``name``: linear operations by constants only, one reduction over samples
    (a mean plus a sum would weigh them by the batch's size), every sample once; checked against the
    engine's ``loss_reduction`` at backward (:mod:`.loss_pool`)."""
    check_pooled(name, args, base.samples, len(pooled) + len(singles))
    reductions = {t.rows.reduction for t in pooled} | ({"sum"} if singles else set())
    if len(reductions - {None}) > 1:
        refuse(f"{name} of a mean over samples and a sum over samples (a weight that follows the batch's size)")
    covered = covered_rows(name, pooled, singles)
    # the weight of the pooled rows: one product (the parts of a sum over slices must share it)
    scalars = (math.prod(pooled[0].rows.scalars),) if pooled and pooled[0].rows.scalars else ()
    scalars += scalars_of(name, args)
    return base._replace(sample_dim=None, pooled=True, reduction=next(iter(reductions - {None}), None),
                         scalars=scalars, covered=covered)  # fmt: skip


def covered_rows(name: str, pooled: list, singles: list) -> frozenset | None:
    """The rows a sum of single samples' values holds (None: a pool over all rows)."""
    parts = [t.rows.covered for t in pooled] + [frozenset([t.rows.row]) for t in singles]
    if len(parts) == 1 or all(p is None for p in parts):
        return parts[0] if len(parts) == 1 else None
    if any(p is None for p in parts) or sum(len(p) for p in parts) != len(frozenset().union(*parts)):
        refuse(f"{name}: a sample's loss counted twice (a single row's values added to a pool that holds it)")
    if len({math.prod(t.rows.scalars) for t in pooled} | ({1.0} if singles else set())) > 1:
        refuse(
            f"{name} of slices of the batch scaled differently (l[:k].sum() * 2 + l[k:].sum(): a weight by position)"
        )
    return frozenset().union(*parts)


def scalars_of(name: str, args) -> tuple:
    """The Python number (or 0-d tensor) ``name`` scales a pooled loss by: x for a product, 1/x for a division."""
    if name not in SCALING:
        return ()
    numbers = [a for a in args[1:] if isinstance(a, (int, float)) and not isinstance(a, bool)]
    numbers += [
        float(a) for a in args if isinstance(a, torch.Tensor) and a.dim() == 0 and getattr(a, "rows", None) is None
    ]
    if name in DIVIDE:
        return tuple(1 / x if x else float("inf") for x in numbers)
    return tuple(float(x) for x in numbers)


def from_batch(index) -> bool:
    return isinstance(index, tuple) and bool(index) and from_batch(index[0]) or getattr(index, "rows", None) is not None


def check_positional(name: str, args, kwargs, lead) -> None:
    """An elementwise product with a tensor that varies along the sample dimension but does not come
    from the batch weighs each sample by its position (``(losses * torch.linspace(1, 3, B)).sum()``).
    A loss *target* made by position is not refused: labels built through Python look the same."""
    if (
        name in LOSSES
        or name in ADDITIVE
        or (name not in SCALING | ELEMENTWISE | ALONG | INDEXED_WRITES and not pointwise(name))
    ):
        return  # a constant added to a sample's values leaves its gradient alone
    from_right = lead.dim() - lead.rows.sample_dim
    for a in leaves(args, kwargs):
        if isinstance(a, torch.Tensor) and getattr(a, "rows", None) is None and a.dim() >= from_right:
            d = a.dim() - from_right
            if a.shape[d] > 1 and not bool((a == a.narrow(d, 0, 1)).all()):
                refuse(f"{name} with a tensor that varies along the sample dimension but does not come from the "
                       "batch (a weight by position)")  # fmt: skip


def check_meeting(name: str, args, kwargs, rows: list) -> None:
    """Several tensors with rows meet: the same samples, in the same order and place."""
    if any(t.rows.written for t in rows if not t.requires_grad):
        refuse(
            f"{name} with values written into the batch's rows by position (w[:2] = 1, a loop over rows: a weight by "
            "position; build masks from the batch, e.g. labels[torch.arange(T) < prompt_len[:, None]] = -100)"
        )
    if not all(t.rows.aligned for t in rows) or len({window_of(t) for t in rows}) > 1:
        refuse(f"{name}: the batch's rows combined with a reordered or shifted copy of them (mixup, negatives)")
    if name in PRODUCTS:
        check_product(name, args, rows)
        return
    if name in LOSSES:  # input, target, weight: batch-first (CTC's log-probabilities: time-major)
        if any(t.rows.sample_dim != loss_sample_dim(name, args, t) for t in rows):
            refuse(f"{name} on tensors whose rows are not the samples")
        return
    if name in ("gather", "take_along_dim"):  # row i's index picks from row i, along another dimension
        dim = args[2] if name == "take_along_dim" and len(args) > 2 else (args[1] if len(args) > 1 else None)
        dim = kwargs.get("dim", dim)
        if isinstance(dim, int) and all(t.rows.sample_dim == 0 for t in rows) and dim % rows[0].dim() != 0:
            return
    from_right = {t.dim() - t.rows.sample_dim for t in rows}  # broadcasting aligns from the right
    if len(from_right) > 1:
        refuse(f"{name} of tensors whose samples lie along different dimensions (pairwise terms)")
    ok = ELEMENTWISE | ADDITIVE | SCALING | LOSSES | VIEWS | {"stack", "cat", "cosine_similarity", "pairwise_distance",
                                                             "broadcast_tensors", "vecdot", "cross"}  # fmt: skip
    if name not in ok:
        refuse(f"{name} of two tensors derived from the batch")


def loss_sample_dim(name: str, args, t) -> int:
    """Where a loss expects the samples: dimension 0, but 1 in CTC's (T, B, C) log-probabilities."""
    return 1 if name == "ctc_loss" and args and t is args[0] else 0


def check_product(name: str, args, rows: list) -> None:
    """Two tracked factors: only a product batched over the samples (bmm, matmul over a leading
    sample dimension, an einsum whose sample letters agree and stay) keeps them apart."""
    if name == "einsum":
        operands = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        inputs, _, result = args[0].replace(" ", "").partition("->")
        letters = set()
        for spec, t in zip(inputs.split(","), operands):
            if getattr(t, "rows", None) is not None and t.rows.sample_dim is not None:
                if "." in spec:
                    refuse("einsum with '...' over two outputs")
                letters.add(spec[t.rows.sample_dim])
        if len(letters) > 1 or (letters and not letters <= set(result)):
            refuse("einsum of two outputs over different samples (e.g. in-batch negatives)")
        return
    batched = name in ("matmul", "__matmul__", "__rmatmul__", "bmm", "baddbmm")
    if not batched or any(t.rows.sample_dim != 0 or t.dim() < 3 for t in rows):
        refuse(f"{name} of two outputs over the sample dimension (e.g. in-batch negatives z @ z.T)")


def check_mean_loss(name: str, args, kwargs, lead) -> None:
    reduction = kwargs.get("reduction", "mean")
    if reduction != "mean" or kwargs.get("size_average") is not None or kwargs.get("reduce") is not None:
        return
    target = kwargs.get("target", args[1] if len(args) > 1 else None)
    soft = isinstance(target, torch.Tensor) and target.is_floating_point()  # probabilities: the mean divides by B
    if kwargs.get("weight", args[2] if len(args) > 2 else None) is not None and not soft:
        refuse(f"{name}(weight=..., reduction='mean') dividing by the batch's total class weight")
    ignore = kwargs.get("ignore_index", args[4] if len(args) > 4 and isinstance(args[4], int) else -100)
    if isinstance(target, torch.Tensor) and not target.is_floating_point() and bool((target == ignore).any()):
        refuse(f"{name}(reduction='mean') with ignored targets, dividing by the batch's count of labelled tokens")


def check_pooled(name: str, args, samples: int, operands: int) -> None:
    """After pooling only linear operations by constants keep Σ_i c·ℓ_i."""
    if name in ADDITIVE or name in VIEWS or name == "mean":
        return
    if name not in SCALING or operands > 1:
        refuse(f"{name} applied to a sum over samples (not linear)")
    divisor = args[1] if name in DIVIDE and len(args) > 1 else None
    if isinstance(divisor, torch.Tensor):
        d = divisor.detach()
        if d.numel() != 1 or float(d) != samples:
            refuse(f"dividing the batch's loss by a tensor ({float(d) if d.numel() == 1 else 'not a scalar'}; "
                   "a Python number is taken as a constant)")  # fmt: skip


def check_outside(name: str, args, kwargs, owned: frozenset | None) -> None:
    """A trainable tensor that is not the model's meets its outputs: a head or a loss parameter
    outside the model would train on unclipped gradients of the private batch."""
    if owned is None:
        return
    for a in leaves(args, kwargs):
        if isinstance(a, torch.Tensor) and getattr(a, "rows", None) is None and a.requires_grad and a.is_leaf:
            if id(a) not in owned:
                raise UnsupportedModuleError(
                    f"{name}: a trainable tensor of shape {tuple(a.shape)} outside the private model meets its "
                    "outputs (a head, or a parameter of the loss): its gradient would not be clipped per sample. "
                    "Make it part of the model (a submodule) before make_private, or freeze it."
                )
