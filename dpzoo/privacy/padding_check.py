"""The first step's check that the collate's padding leaves each sample's gradient alone.

A collate that pads every batch to its longest sequence (``pad_sequence``, a tokenizer's
``padding=True``) gives sample i a shape that depends on the other samples drawn with it. If the
model then reads the padding (no attention mask, a mean over every position, positions shifted by
left padding), or the loss has gradient on padded positions, sample i's clipped gradient depends
on the others: a neighbouring batch moves the released sum by more than R (about 4 R measured).
The self-check's single-sample runs slice rows of the already padded batch and cannot
see it. This check can: for a few rows of the loader's first batch whose collated shape depends on
the batch, the sample is run alone, without the padding (its row of every padded input, the
batch's and those the loop derived from them such as a mask or position ids, cut to the length
it has collated alone: a collate that draws at random gives the same sample), and its outputs must equal its
row of the batch's on the positions both have, with no loss gradient on the others; right padding
lines them up as a prefix, left padding as a suffix. A collate that truncates samples to the
batch's shortest is refused outright. Rows whose shape does not depend on the batch cost nothing.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import SelfCheckError
from ..grad_norms.tensors import output_tensors

__all__ = ["check_padding"]

MAX_ROWS_SCANNED = 32  # rows of the first batch collated alone, looking for a padded one
MAX_RUNS = 3  # padded rows run alone
FIX = "pass an attention mask the model honours and pad the labels with ignore_index, or pad every sample to one length"


def check_padding(
    model: nn.Module, loader, args: tuple, kwargs: dict, batch_outs: list, cotangents: list, tol: float
) -> None:
    """Refuse (:class:`~dpzoo.SelfCheckError`) a padded sample whose run alone differs from its row
    of the batch (see the module docstring). ``loader``: the engine's, with ``first_batch`` (the
    tracked first batch and its rows' dataset indices); ``(args, kwargs)``: the model's first
    training call, ``batch_outs``: its outputs in eval mode, ``cotangents``: the loss's gradients
    at them. Checks nothing when no input of the call is a tensor of the first batch."""
    first = getattr(loader, "first_batch", None)
    if first is None or not batch_outs:
        return
    batch, indices = first
    batch_leaves = tree_flatten(batch)[0]
    call_leaves, call_spec = tree_flatten((args, kwargs))
    where = [_position(t, batch_leaves) for t in call_leaves]
    if all(p is None for p in where):
        return
    runs = 0
    for k in range(min(len(indices), MAX_ROWS_SCANNED)):
        alone = tree_flatten(loader.collate_fn([loader.dataset[indices[k]]]))[0]
        if len(alone) != len(batch_leaves) or not _padded(k, alone, where, call_leaves):
            continue
        failures = []
        for end in (False, True):  # right padding (a prefix), then left padding (a suffix)
            inputs = _alone_inputs(call_leaves, where, alone, k, len(indices), end)
            call_args, call_kwargs = tree_unflatten(inputs, call_spec)
            try:
                outs = output_tensors(model(*call_args, **call_kwargs))
            except (RuntimeError, ValueError, IndexError) as e:
                failures.append(f"it does not run alone ({str(e).splitlines()[0][:120]})")
                continue
            found = _compare(outs, [o[k] for o in batch_outs], [c[k] for c in cotangents], end, tol)
            if found is None:
                break
            failures.append(found)
        else:
            raise SelfCheckError(
                f"Self-check failed: sample {k} of the first batch, collated alone, does not give its row of the padded "
                f"batch ({'; '.join(dict.fromkeys(failures))}): the collate pads each sample to the batch's longest "
                f"and the padding reaches its gradient, so each sample's gradient depends on the others (false ε). "
                f"{FIX[0].upper()}{FIX[1:]}."
            )
        runs += 1
        if runs == MAX_RUNS:
            return


def _position(t, batch_leaves: list) -> int | None:
    """Which leaf of the first batch the call's input ``t`` is: the same storage, or else the same
    values (a copy: ``batch.to("cuda")``, ``mask.bool()``)."""
    if not isinstance(t, torch.Tensor):
        return None
    same = [i for i, b in enumerate(batch_leaves) if isinstance(b, torch.Tensor) and b.shape == t.shape]
    for i in same:
        if batch_leaves[i].data_ptr() == t.data_ptr() and batch_leaves[i].device == t.device:
            return i
    for i in same:
        if torch.equal(batch_leaves[i].to(t.device, t.dtype), t):
            return i
    return None


def _padded(k: int, alone: list, where: list, call_leaves: list) -> bool:
    """Whether sample ``k`` has another shape alone than in the batch (padded there); a sample cut
    shorter in the batch than alone (truncated to the batch's shortest) is refused."""
    padded = False
    for t, p in zip(call_leaves, where):
        if p is None or not isinstance(alone[p], torch.Tensor) or alone[p].dim() != t.dim():
            continue
        if any(a > b for a, b in zip(alone[p].shape[1:], t.shape[1:])):
            raise SelfCheckError(
                f"Self-check failed: sample {k} of the first batch is longer alone {tuple(alone[p].shape[1:])} than its "
                f"row of the batch {tuple(t.shape[1:])}: the collate truncates samples to the batch's shortest, so "
                f"what each sample contributes depends on the others (false ε). Truncate to a fixed length instead."
            )
        padded = padded or alone[p].shape[1:] != t.shape[1:]
    return padded


def _alone_inputs(call_leaves: list, where: list, alone: list, k: int, rows: int, end: bool) -> list:
    """The call's inputs for sample ``k`` alone: row ``k`` of every batch-first input, cut to the
    sample's own length (a prefix, or with ``end`` a suffix) where its shape is a padded one: the
    batch's own tensors to their shape collated alone, tensors the loop derived from them (a
    mask, position ids) likewise. The values are the batch's (a collate that draws at random,
    masking tokens, gives the same sample); only the padding goes."""
    cuts = {
        tuple(t.shape[1:]): alone[p].shape[1:]
        for t, p in zip(call_leaves, where)
        if p is not None and isinstance(alone[p], torch.Tensor) and alone[p].dim() == t.dim()
    }
    inputs = []
    for t in call_leaves:
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == rows:
            row = t[k : k + 1]
            if tuple(t.shape[1:]) in cuts:
                row = row[(slice(None),) + _window(cuts[tuple(t.shape[1:])], t.shape[1:], end)]
            inputs.append(row)
        else:
            inputs.append(t)
    return inputs


def _window(small, large, end: bool) -> tuple:
    """Slices of the ``large`` shape holding the ``small`` one: its start, or with ``end`` its end."""
    return tuple(slice(n - m, n) if end else slice(0, m) for m, n in zip(small, large))


def _compare(alone_outs: list, rows: list, cotangents: list, end: bool, tol: float) -> str | None:
    """What differs between the sample's outputs alone and its rows of the batch's, lined up at
    the start (or with ``end`` at the end) of each longer dimension: an output value, or loss
    gradient on positions the sample alone does not have. None: nothing."""
    if len(alone_outs) != len(rows):
        return "its outputs are not those of a row of the batch"
    for a, b, c in zip(alone_outs, rows, cotangents):
        a = a.detach()[0] if a.dim() == b.dim() + 1 and a.shape[0] == 1 else a.detach()
        if a.dim() != b.dim() or any(m > n for m, n in zip(a.shape, b.shape)):
            return f"output shapes {tuple(a.shape)} alone vs {tuple(b.shape)} in the batch"
        inside = _window(a.shape, b.shape, end)
        gap = (a.double() - b[inside].double()).abs().max().item() if a.numel() else 0.0
        if gap > tol * max(b.abs().max().item(), 1e-3):
            return f"outputs differ by {gap:.3g} {'aligned at the end' if end else 'on its own positions'}"
        outside = c.detach().clone()
        outside[inside] = 0
        if bool(outside.ne(0).any()):
            return (
                "the loss has gradient on its padding positions (labels there not ignore_index, or left padding "
                "with a shifted causal loss, whose last padding position predicts the first token)"
            )
    return None
