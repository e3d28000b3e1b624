"""The first step's check that the collate's padding leaves each sample's output alone.

A collate that pads every batch to its longest sequence (``pad_sequence``, a tokenizer's
``padding=True``) gives sample i a shape that depends on the other samples drawn with it. If the
model then reads the padding (no attention mask, a mean over every position, positions shifted by
left padding), sample i's output, and so its clipped gradient, depend on the others: a
neighbouring batch moves the released sum by more than R (about 4 R measured, issue 33). The
self-check's single-sample runs slice rows of the already padded batch and cannot see it. This
check can: for a few rows of the loader's first batch, each sample is collated *alone* and run
alone, and its outputs must equal its row of the batch's outputs on the positions both have (a
prefix for right padding, a suffix for left padding). Rows whose collated shape does not depend on
the batch are skipped, so fixed-length collates cost nothing.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import SelfCheckError
from ..grad_norms.hooks import output_tensors

__all__ = ["check_padding"]

MAX_ROWS_SCANNED = 32  # rows of the first batch collated alone, looking for a padded one
MAX_RUNS = 3  # padded rows run alone


def check_padding(
    model: nn.Module, loader, args: tuple, kwargs: dict, batch_outs: list, cotangents: list, tol: float
) -> None:
    """Refuse (:class:`~dpzoo.SelfCheckError`) when a sample collated and run alone gives other
    outputs than its row of the padded batch. ``loader``: the engine's, with ``first_batch`` (the
    tracked first batch and its dataset indices); ``(args, kwargs)``: the model's first training
    call; ``batch_outs``: its outputs in eval mode, ``cotangents``: the loss's gradients at them,
    which must be 0 on a row's padded positions (a loss that counts padding, labels padded with a
    class instead of ``ignore_index``, weighs each sample by the batch's longest). Checks nothing
    when the call's inputs cannot be found in the first batch (the loop built them otherwise)."""
    first = getattr(loader, "first_batch", None)
    if first is None or not batch_outs:
        return
    batch, indices = first
    batch_leaves, spec = tree_flatten(batch)
    call_leaves, call_spec = tree_flatten((args, kwargs))
    where = [_position(t, batch_leaves) for t in call_leaves]
    if not any(p is not None for p in where):
        return
    rows, runs = len(indices), 0
    for k in range(min(rows, MAX_ROWS_SCANNED)):
        alone = tree_flatten(loader.collate_fn([loader.dataset[indices[k]]]))[0]
        if len(alone) != len(batch_leaves) or not _padded(alone, batch_leaves, where, call_leaves):
            continue
        inputs = [_alone_input(t, p, alone, k, rows) for t, p in zip(call_leaves, where)]
        a, kw = tree_unflatten(inputs, call_spec)
        try:
            outs = output_tensors(model(*a, **kw))
        except (RuntimeError, ValueError, IndexError):
            return  # the model cannot run this sample alone as collated: nothing to compare
        gap, padding = _gap(outs, [o[k] for o in batch_outs], [c[k] for c in cotangents], tol)
        if padding:
            raise SelfCheckError(
                f"Self-check failed: the loss has gradient on sample {k}'s padding positions (the collate pads each "
                "sample to the batch's longest), so each sample's loss depends on the others (false ε): pad the "
                "labels with the loss's ignore_index (-100), or pad every sample to one fixed length."
            )
        if gap is not None:
            raise SelfCheckError(
                f"Self-check failed: sample {k} collated alone gives other outputs than its row of the padded batch "
                f"(max difference {gap:.3g}): the collate pads each sample to the batch's longest and the model reads "
                "the padding, so each sample's gradient depends on the others (false ε). Pass an attention mask the "
                "model honours, or pad every sample to one fixed length (padding='max_length')."
            )
        runs += 1
        if runs == MAX_RUNS:
            return


def _position(t, batch_leaves: list) -> int | None:
    """Which leaf of the first batch the call's input ``t`` is (the same storage and shape)."""
    if not isinstance(t, torch.Tensor):
        return None
    for i, b in enumerate(batch_leaves):
        if isinstance(b, torch.Tensor) and b.shape == t.shape and b.data_ptr() == t.data_ptr():
            return i
    return None


def _padded(alone: list, batch_leaves: list, where: list, call_leaves: list) -> bool:
    """A call input whose sample, collated alone, has another shape than its row in the batch."""
    for t, p in zip(call_leaves, where):
        if p is not None and isinstance(alone[p], torch.Tensor) and alone[p].shape[1:] != t.shape[1:]:
            return True
    return False


def _alone_input(t, position: int | None, alone: list, k: int, rows: int):
    if position is not None:
        return alone[position].to(t.device)
    if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == rows:
        return t[k : k + 1]
    return t


def _gap(alone_outs: list, rows: list, cotangents: list, tol: float) -> tuple[float | None, bool]:
    """(the largest difference between outputs alone and batch rows on the positions both have,
    prefix or suffix along each dimension whose size differs, if over ``tol``, else None; whether
    the loss's gradient is nonzero on the row's positions the sample alone does not have)."""
    if len(alone_outs) != len(rows):
        return None, False
    for a, b, c in zip(alone_outs, rows, cotangents):
        a = a.detach()[0] if a.dim() == b.dim() + 1 and a.shape[0] == 1 else a.detach()
        if a.dim() != b.dim():
            return None, False
        gaps, regions = [], []
        for end in (False, True):
            sl = tuple(
                slice(None) if m == n else (slice(n - min(m, n), n) if end else slice(0, min(m, n)))
                for m, n in zip(a.shape, b.shape)
            )
            al = tuple(
                slice(None) if m == n else (slice(m - min(m, n), m) if end else slice(0, min(m, n)))
                for m, n in zip(a.shape, b.shape)
            )
            gaps.append((a[al].double() - b[sl].double()).abs().max().item() if a[al].numel() else 0.0)
            regions.append(sl)
        scale = b.abs().max().item() + 1e-30
        if min(gaps) > tol * max(scale, 1e-3):
            return min(gaps), False
        outside = c.detach().clone()
        outside[regions[gaps.index(min(gaps))]] = 0  # the positions the sample alone has
        if bool(outside.ne(0).any()):
            return None, True
    return None, False
