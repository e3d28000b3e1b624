"""In-place writes during a DP step that change which values the batch's rows hold: a write into
rows chosen by position (``w[:2] = 1``, ``l[:4].mul_(-1)``), and a write into the trained model's
parameters or buffers (released with the weights). Read by :mod:`.sample_rows`.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from .row_ops import ADDITIVE, leaves, window_of
from .row_rules import State

__all__ = [
    "POSITIONAL_WRITES",
    "by_position",
    "in_place",
    "mixed",
    "moved",
    "positional_write",
    "released",
    "note_model",
]

MODEL: dict = {}  # the model last called on the batch (a weak reference): its state is released


def note_model(model: torch.nn.Module) -> None:
    MODEL["ref"] = weakref.ref(model)


POSITIONAL_WRITES = ("__setitem__", "index_fill_", "index_copy_", "index_add_", "index_put_")


def positional_write(name: str, args, kwargs) -> bool:
    """An in-place write into the sample rows chosen by position (an int, a slice, an index that
    does not come from the batch), not by the batch's own values (``y[y == -1] = 0``)."""
    target = args[0]
    if target.rows.sample_dim != 0:
        return False
    if name == "__setitem__":
        index = args[1] if len(args) > 1 else None
        first = index[0] if isinstance(index, tuple) and index else index
        if isinstance(first, slice) and first == slice(None) or first is Ellipsis or first is None:
            return False
        return not isinstance(getattr(first, "rows", None), State)
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    index = kwargs.get("index", args[2] if len(args) > 2 else None)
    if name == "index_put_":
        dim, index = 0, (args[1][0] if len(args) > 1 and args[1] else None)
    return dim == 0 and not isinstance(getattr(index, "rows", None), State)


KEEPS_VALUES = ("requires_grad_", "retain_grad", "share_memory_", "detach_")


def by_position(name: str, args, kwargs, base) -> bool:
    """An in-place operation that changes the values of a view holding only some of ``base``'s
    rows, picked by position (``l[:4].mul_(-1)``, ``l[::2]``, ``l[0]``): ``base``'s samples are
    now weighted, or their data rewritten, by where they sit in the batch. A constant added to a
    loss leaves its gradient alone."""
    view = args[0]
    if name in KEEPS_VALUES or base.rows.sample_dim is None:
        return False
    if (
        base.requires_grad
        and name in ADDITIVE
        and not any(getattr(a, "rows", None) is not None for a in leaves(args[1:], kwargs))
    ):
        return False
    return view.rows.row is not None or window_of(view) != window_of(base) or view.rows.aligned != base.rows.aligned


def in_place(name: str) -> bool:
    return (name.endswith("_") and not name.startswith("_")) or name in (
        "__iadd__",
        "__isub__",
        "__imul__",
        "__itruediv__",
    )


def mixed(rows: State) -> bool:
    return rows.stat or rows.pooled or not rows.aligned or rows.sample_dim != 0


def moved(old: State, new: State) -> bool:
    """An in-place op on a view changed which samples it holds (``x[0] *= 2`` keeps row 0's own)."""
    if (new.stat or new.pooled) and not (old.stat or old.pooled):
        return True
    return (new.row, new.aligned, new.window, new.sample_dim) != (old.row, old.aligned, old.window, old.sample_dim)


def released(target: torch.Tensor) -> bool:
    """``target`` is, or aliases, a parameter (of any module) or a parameter or buffer of the model
    being trained (:func:`note_call`): what is written into it is released with the weights."""
    if isinstance(target, torch.nn.Parameter):
        return True
    model = MODEL["ref"]() if "ref" in MODEL else None
    if model is None:
        return False
    with contextlib.suppress(RuntimeError, NotImplementedError):
        ptr = target.untyped_storage().data_ptr()
        return bool(ptr) and any(t.untyped_storage().data_ptr() == ptr for t in (*model.parameters(), *model.buffers()))
    return False
