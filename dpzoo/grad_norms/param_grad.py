"""One parameter's per-sample gradients in one step, every use gathered: :class:`ParamGrad`.

It owns the choices made on a parameter's uses: ghost or instantiation per use (the planner's,
the BK rule, or the hooks' forced mode), summing many uses once (a recurrent cell called every
time step) instead of O(uses²) cross terms, the cross terms themselves (:mod:`.reps`), and the
floating-point guard on ghost norms (:mod:`.float_guard`). It offers :meth:`ParamGrad.sq_norm`,
:meth:`ParamGrad.clipped_sum` and :meth:`ParamGrad.instantiate`.
"""

from __future__ import annotations

import torch

from ..errors import InvalidArgumentError
from .float_guard import guard
from .half import shared_scale
from .reps import (
    Dense,
    OneHot,
    RowSparse,
    clipped_sum,
    inner,
    instantiate,
    prefers_ghost,
    row_sparse,
    sq_norm,
    without_samples,
)

__all__ = ["ParamGrad"]


class ParamGrad:
    """The per-sample gradients of one parameter in one step, ``g_i = Σ_u g_{u,i}`` over its
    uses ``u`` (one representation each), and how to compute with them.

    ``ghost``: None chooses ghost norm or instantiation per use, by ``choices`` (one bool per use,
    True: ghost; the planner's, :mod:`dpzoo.grad_norms.cost`) or else by the BK rule
    (:func:`prefers_ghost`); True / False force one. :meth:`sq_norm` settles the representations
    once (BK-MixOpt, BK paper §3.2): a use on the instantiation path is formed once, and the
    clipped sum reuses it (its factors are dropped); dense uses are summed into one before any norm
    (no cross term, so uses that cancel give exactly 0); more than two uses, unless ghost is forced,
    are summed into one dense gradient (O(uses) instead of O(uses²) cross terms).
    """

    def __init__(self, reps: list, ghost: bool | None = None, choices: list[bool] | None = None):
        if not reps:
            raise InvalidArgumentError("a ParamGrad needs at least one representation: build it from a rule's output")
        if choices is not None and len(choices) != len(reps):
            raise InvalidArgumentError(f"choices: one per use ({len(reps)}), got {len(choices)}")
        self.reps = list(reps)
        self.ghost = ghost
        self.choices = choices
        self._sq: torch.Tensor | None = None

    def _on_ghost(self, i: int, rep) -> bool:
        if self.ghost is not None:
            return self.ghost
        return self.choices[i] if self.choices is not None else prefers_ghost(rep)

    @property
    def batch_size(self) -> int:
        return self.reps[0].batch_size

    def _settle(self) -> None:
        rs = [
            Dense(instantiate(r)) if not isinstance(r, Dense) and not self._on_ghost(i, r) else r
            for i, r in enumerate(self.reps)
        ]
        dense = [r.grad for r in rs if isinstance(r, Dense)]
        if len(dense) > 1:  # summed before the norm: exact where uses cancel (‖g - g‖ = 0, not √ε·‖g‖)
            total = dense[0]
            for d in dense[1:]:
                total = total + d
            rs = [Dense(total)] + [r for r in rs if not isinstance(r, Dense)]
        if len(rs) > 2 and self.ghost is not True:
            dense = instantiate(rs[0])
            for r in rs[1:]:
                dense = dense + instantiate(r)
            rs = [Dense(dense)]
        self.reps = rs

    def sq_norm(self) -> torch.Tensor:
        """‖g_i‖² for every sample (Tensor[B]), every cross term of a multi-use parameter included."""
        if self._sq is None:
            self._settle()
            rs = self.reps
            ghost = self.ghost is not False  # what is not Dense after settling is on the ghost path
            total = sq_norm(rs[0], ghost=ghost)
            for i in range(len(rs)):
                if i:
                    total = total + sq_norm(rs[i], ghost=ghost)
                for j in range(i + 1, len(rs)):  # cross terms of a parameter used twice
                    total = total + 2 * inner(rs[i], rs[j], ghost=ghost)
            total = total.clamp_min(0)
            if not all(isinstance(r, Dense) for r in rs):  # a dense norm is that of the very tensor summed
                total = guard(rs, total)
            self._sq = total
        return self._sq

    def clipped_sum(self, scale: torch.Tensor, drop: torch.Tensor | None = None) -> torch.Tensor:
        """Σ_i scale_i g_i over every use (the parameter's shape); samples where ``drop`` is True
        contribute exactly 0, whatever their values (see :func:`without_samples`)."""
        reps = self.reps if drop is None else [without_samples(r, drop) for r in self.reps]
        scale = shared_scale(reps, scale)  # one factor for every use: uses that cancel must share it
        total = clipped_sum(reps[0], scale)
        for r in reps[1:]:
            total = total + clipped_sum(r, scale)
        return total

    def instantiate(self) -> torch.Tensor:
        """The per-sample gradients, (B, *shape), every use summed."""
        total = instantiate(self.reps[0])
        for r in self.reps[1:]:
            total = total + instantiate(r)
        return total

    def row_sparse(self) -> "RowSparse | None":
        """The rows each sample touched, if every use is an embedding lookup; else None."""
        rs = self.reps
        if not all(isinstance(r, OneHot) for r in rs):
            return None
        merged = (
            rs[0]
            if len(rs) == 1
            else OneHot(torch.cat([r.index for r in rs], 1), torch.cat([r.right for r in rs], 1), rs[0].num_rows)
        )
        return row_sparse(merged)
