"""The estimate of one use of a parameter on each path (ghost norm or instantiation) that the
planner (:mod:`.cost`) compares, and the record of its choice: :class:`UseCost`, :func:`use_cost`
(the multiply-add and memory counts of :mod:`.cost`'s docstring)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from . import reps as R

__all__ = ["UseCost", "use_cost", "TRAFFIC"]

# multiply-adds one instantiated element costs besides its arithmetic (writing the per-sample
# tensor, reading it back for the norm and the sum), fitted on CPU (benchmarks/planner_cpu.py,
# benchmarks/results/planner_cpu): with float32 dense norms (2026-11-27) instantiation is the faster
# path for all four of GPT-2 4x256's layers at B 16, T 128 (ties at 158-254) and ResNet-18-GN@32's
# stem, first stage and 1x1 downsample (ties at 2945, 140 and 10), ghost for its 3x3 later stages
# (ties at 2.4 and below); any value in (2.4, 10) orders every shape whose paths differ by more
# than 0.1 ms as measured (tests/test_cost_planner.py). It was 200 with float64 norms.
TRAFFIC = 6


@dataclass(frozen=True)
class UseCost:
    """One use of a parameter in a step, its two costs and the planner's choice."""

    param: str
    use: int
    kind: str  # "linear" (Factored), "embedding" (OneHot) or "dense" (no choice)
    ghost_flops: float
    instantiate_flops: float
    ghost_bytes: float
    instantiate_bytes: float
    ghost: bool = True
    why: str = ""
    ghost_ms: float | None = None  # autotune: measured (timed) or converted from the model, else None
    instantiate_ms: float | None = None
    timed: bool = False  # ghost_ms / instantiate_ms measured on this device, not converted
    # on a GPU, a single use instantiated, formed for its norm and freed (:mod:`.formed`): held by
    # nothing, so it takes no share of the budget, but the formed float32 tensor must fit it;
    # timed only (the model does not price it)
    freed_ms: float | None = None
    freed: bool = False
    freed_bytes: float = 0.0

    def time(self, ghost: bool) -> float:
        """The cost the planner compares: milliseconds when autotuned, else multiply-adds."""
        if self.ghost_ms is not None and self.instantiate_ms is not None:
            return self.ghost_ms if ghost else self.instantiate_ms
        return self.ghost_flops if ghost else self.instantiate_flops

    def as_dict(self) -> dict:
        return {
            "param": self.param,
            "use": self.use,
            "kind": self.kind,
            "choice": "dense" if self.kind == "dense" else ("ghost" if self.ghost else "instantiate"),
            "why": self.why,
            "ghost_gflop": self.ghost_flops / 1e9,
            "instantiate_gflop": self.instantiate_flops / 1e9,
            "ghost_mb": self.ghost_bytes / 2**20,
            "instantiate_mb": self.instantiate_bytes / 2**20,
            "ghost_ms": self.ghost_ms,
            "instantiate_ms": self.instantiate_ms,
            "freed_ms": self.freed_ms,
            "freed": self.freed,
            "freed_mb": self.freed_bytes / 2**20,
            "timed": self.timed,
        }


def use_cost(param: str, use: int, rep) -> UseCost:
    """The estimated multiply-adds and memory of ``rep`` on each path (see the module docstring);
    one row per parameter, use and shape, made once (frozen: a planner runs every step)."""
    if isinstance(rep, R.Factored):
        right = R.right_like(rep)
        return _linear_cost(param, use, *rep.left.shape, right.shape[3], max(right.element_size(), 4))
    if isinstance(rep, R.OneHot):
        return _embedding_cost(
            param, use, *rep.index.shape, rep.right.shape[-1], rep.right.element_size(), rep.num_rows
        )
    return _dense_cost(param, use, rep.grad.numel(), rep.grad.element_size())


@functools.lru_cache(maxsize=1 << 12)
def _linear_cost(param: str, use: int, b: int, g: int, t: int, p: int, d: int, size: int) -> UseCost:
    """A factored use's row; ``size``: bytes an entry, at least 4 (half factors' Grams and products are float32)."""
    ghost = 2 * b * g * t * t * (p + d) + b * g * t * t + 2 * b * g * t * p * d
    inst = 2 * b * g * t * p * d + (2 + TRAFFIC) * b * g * p * d
    held = b * g * p * d * size
    return UseCost(param, use, "linear", ghost, inst, b * g * t * t * size, held, freed_bytes=held)


@functools.lru_cache(maxsize=1 << 12)
def _embedding_cost(param: str, use: int, b: int, t: int, d: int, size: int, rows: int) -> UseCost:
    ghost = b * t * t * (d + 1) + b * t * d
    inst = (3 + TRAFFIC) * b * rows * d + b * t * d
    return UseCost(param, use, "embedding", ghost, inst, b * t * t * size, b * rows * d * size)


@functools.lru_cache(maxsize=1 << 12)
def _dense_cost(param: str, use: int, numel: int, size: int) -> UseCost:
    """A dense use's row (no choice to make)."""
    return UseCost(param, use, "dense", 2 * numel, 2 * numel, 0, numel * size, why="no choice")
