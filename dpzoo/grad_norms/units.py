"""Privacy units of several rows: a user's examples clipped together, exactly.

With user-level DP the clipped quantity is a user's gradient in the step, the sum of their
examples' gradients, g_U = Σ_{i∈U} g_i. Every representation of :mod:`.reps` stays exact under
that sum, so a batch of B rows is turned into a batch of U units before any norm is taken:

* :class:`~.reps.Dense`: the rows' gradients summed per unit;
* :class:`~.reps.Factored`, g_i = Σ_t L_{i,t} ⊗ R_{i,t}: a unit's positions are those of all its
  rows, g_U = Σ_{i∈U} Σ_t L_{i,t} ⊗ R_{i,t}, laid side by side (K·T positions, K the most rows a
  unit has; a unit with fewer gets zero positions, which add nothing). Its ghost norm is then
  Σ_{i,j∈U} ⟨g_i, g_j⟩, the per-unit blocks of the Gram matrices the per-row ghost norm forms;
* :class:`~.reps.OneHot` (an embedding lookup): the same, with row 0 and a zero gradient as padding.

Norms, clipped sums, cross terms between uses (tied embeddings, Phantom Clipping), the
ghost-or-instantiate planner and the rounding bound then work on units unchanged: they read
the units' shapes. Instantiating a unit costs what instantiating its rows costs (U·K·T rows of
products, U ≤ B gradients held); its ghost norm K times a row's, so the planner moves wide
layers to instantiation as K grows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidArgumentError
from . import reps as R

__all__ = ["UnitLayout", "unit_layout", "group_rep"]


@dataclass(frozen=True)
class UnitLayout:
    """Row i of the batch is row ``slot[i]`` (of ``width``) of unit ``unit[i]`` (of ``units``)."""

    unit: torch.Tensor  # (B,) long
    slot: torch.Tensor  # (B,) long
    units: int
    width: int

    @property
    def rows(self) -> int:
        return self.unit.shape[0]


def unit_layout(groups) -> UnitLayout:
    """The layout of ``groups`` (one unit id per row, ids 0 … U−1, every id used)."""
    unit = torch.as_tensor(groups).detach().cpu()
    if unit.dim() != 1 or unit.dtype not in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        raise InvalidArgumentError(
            f"groups must be a 1-D integer tensor (one privacy-unit id per row), got {unit.dtype} {tuple(unit.shape)}"
        )
    unit = unit.long()
    if unit.numel() == 0:
        return UnitLayout(unit, unit.clone(), 0, 0)
    counts = torch.bincount(unit) if unit.min() >= 0 else None
    if counts is None or (counts == 0).any():
        raise InvalidArgumentError(
            f"groups must number the units of the batch 0 … U−1 with every id used, got ids {sorted(set(unit.tolist()))[:8]}"
        )
    order = torch.argsort(unit, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(unit)
    slot[order] = torch.arange(unit.numel()) - starts[unit[order]]
    return UnitLayout(unit, slot, int(counts.numel()), int(counts.max()))


def _by_unit(t: torch.Tensor, layout: UnitLayout) -> torch.Tensor:
    """(B, *rest) → (U, K, *rest): row i at [unit[i], slot[i]], zeros elsewhere."""
    out = t.new_zeros(layout.units, layout.width, *t.shape[1:])
    out[layout.unit.to(t.device), layout.slot.to(t.device)] = t
    return out


def group_rep(rep: R.Rep, layout: UnitLayout) -> R.Rep:
    """``rep`` (one gradient per row) as one gradient per unit, exactly (see the module docstring)."""
    if rep.batch_size != layout.rows:
        raise InvalidArgumentError(f"groups has {layout.rows} rows but the step's gradients have {rep.batch_size}")
    if layout.width == 1 and torch.equal(layout.unit, torch.arange(layout.rows)):
        return rep  # one row per unit, in order: nothing to do
    if isinstance(rep, R.Dense):
        out = rep.grad.new_zeros(layout.units, *rep.grad.shape[1:])
        return R.Dense(out.index_add_(0, layout.unit.to(rep.grad.device), rep.grad))
    if isinstance(rep, R.Factored):
        b, g, t, r = rep.left.shape
        left = _by_unit(rep.left, layout).transpose(1, 2).reshape(layout.units, g, layout.width * t, r)
        right = _by_unit(rep.right, layout).transpose(1, 2)
        return R.Factored(left, right.reshape(layout.units, g, layout.width * t, rep.right.shape[3]), rep.shape)
    index = _by_unit(rep.index, layout).flatten(1, 2)
    return R.OneHot(index, _by_unit(rep.right, layout).flatten(1, 2), rep.num_rows)
