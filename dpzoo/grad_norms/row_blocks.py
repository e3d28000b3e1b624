"""Clipped sums over many rows, taken by blocks of whole samples added in float64.

A clipped sum from factors (the ghost path, a freed use, an embedding's rows) is one float32
product over the B·T rows: every row goes into one running sum, so a sample's terms round against
the other samples' total, not against its own. An independent review (2026-11-28) released a share
f(D) − f(D without i) of 1.106 R at B = 997, T = 2,048 with ordinary, non-cancelling data (1.015 R
on the ghost path at B = 2,217, T = 128): up to about u·rows of R. A sum over more than
:data:`MAX_ROWS` rows (a quarter of that where the product runs on tensor cores, taken to
truncate: 4u, as :mod:`.formed`) is taken by blocks of whole samples, each block's product as
before and the blocks' results added in float64: a sample's terms then round against at most
MAX_ROWS rows, u · 2¹⁵ = 2⁻⁹ of R (the rounding of its own terms is :mod:`.sum_guard`'s). A sample
whose positions alone exceed the limit is a block of its own. The bf16 table's steps (B·T ≤ 2¹³)
run as one block, as before; what remains is the float32 total's own rounding, as on every path.
"""

from __future__ import annotations

import torch

from . import reps as R
from .half import HALF, TENSOR_CORE_DEVICES

__all__ = ["MAX_ROWS", "flagged_clipped_sum", "clipped_sum"]

MAX_ROWS = 1 << 15  # rows a float32 product adds into one running sum (2¹³ on tensor cores)


def clipped_sum(rep, scale: torch.Tensor) -> torch.Tensor:
    """:func:`.reps.clipped_sum` by blocks of at most MAX_ROWS rows: a sum whose scaled factor lost
    bits in any block is taken whole in float64."""
    total, lost = flagged_clipped_sum(rep, scale)
    return R.clipped_sum(rep, scale) if lost is not None and bool(lost) else total


def flagged_clipped_sum(rep, scale: torch.Tensor, blocks: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`.reps.flagged_clipped_sum` by blocks of whole samples of at most MAX_ROWS rows, their
    results added in float64; the members of a stack (``blocks``) each summed on their own."""
    per = _samples_per_block(rep, blocks)
    if per is None:
        return R.flagged_clipped_sum(rep, scale, blocks)
    if blocks > 1:
        b = rep.batch_size // blocks
        parts = [
            flagged_clipped_sum(_samples(rep, m * b, (m + 1) * b), scale[m * b : (m + 1) * b]) for m in range(blocks)
        ]
        return torch.stack([total for total, _ in parts]), _any([lost for _, lost in parts])
    total, flags = None, []
    for i in range(0, rep.batch_size, per):
        part, lost = R.flagged_clipped_sum(_samples(rep, i, i + per), scale[i : i + per])
        total = part.double() if total is None else total.add_(part)
        flags.append(lost)
    assert total is not None
    return total.to(part.dtype), _any(flags)


def _samples_per_block(rep, blocks: int) -> int | None:
    """Samples a block of ``rep``'s sum holds, or None where one product may add every row (a dense
    use, float64 factors, few rows)."""
    if isinstance(rep, R.Dense):
        return None
    if isinstance(rep, R.Factored):
        positions, right = rep.left.shape[2], R.right_like(rep)
        tensor_cores = rep.left.dtype == right.dtype and rep.left.dtype in HALF
        tensor_cores = tensor_cores and rep.left.device.type in TENSOR_CORE_DEVICES
    else:
        positions, right, tensor_cores = rep.index.shape[1], rep.right, False
    limit = MAX_ROWS // 4 if tensor_cores else MAX_ROWS
    if right.dtype == torch.float64 or rep.batch_size // blocks * positions <= limit:
        return None
    return max(1, limit // max(positions, 1))


def _samples(rep, start: int, stop: int):
    """Samples ``start`` to ``stop`` of a factored use or a lookup."""
    if isinstance(rep, R.Factored):
        return R.Factored(rep.left[start:stop], rep.right[start:stop], rep.shape)
    return R.OneHot(rep.index[start:stop], rep.right[start:stop], rep.num_rows)


def _any(flags: list) -> torch.Tensor | None:
    """Whether any of the device bools (or None) ``flags`` is True; None if all are None."""
    out = None
    for f in flags:
        if f is not None:
            out = f if out is None else out | f
    return out
