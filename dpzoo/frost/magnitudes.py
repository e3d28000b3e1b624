"""Private partition-wise gradient magnitudes (PGMs), DP-FROST §4.4 (Defs. 7–9, Lemma 3).

For a set S of partitions and per-example gradients g(x):

* ``"mg"`` (DP-MG, μ^a): clip g(x) to α-norm c, sum over examples, and take each partition's
  α-norm divided by |P_i|^{1/α}. Sensitivity c / (min_P |P|)^{1/α}.
* ``"mgn"`` (DP-MGN, μ^b): first divide each partition's gradient by |P_i|^{1/α}, then clip the
  concatenation to c̃ = c / (mean_P |P|)^{1/α}, sum, and take the α-norms. Sensitivity c̃.
* ``"mgna"`` (DP-MGNA, μ^c): as DP-MGN on the element-wise absolute values. Sensitivity c̃.

Why these are sensitivities: one example changes the summed vector by u with ‖u‖_α ≤ threshold,
so the vector of partition norms moves by at most (‖u_{P_i}‖_α)_i, whose ℓ2 norm is ≤ ‖u‖_α for
α ∈ {1, 2}; DP-MG's division by |P_i|^{1/α} ≥ (min |P|)^{1/α} scales that down. The tests check
the bound on random gradients.

The per-example gradients come from dpzoo's hooks (:meth:`NormHooks.per_sample_grads`), in
physical chunks; parameters outside the partitions being measured are frozen meanwhile, so the
clipping covers only them (Lemma 1).
"""

from __future__ import annotations

import torch

from ..errors import InvalidArgumentError
from ..grad_norms.reps import RowSparse
from .partitions import Partition

__all__ = ["METHODS", "sensitivity", "clip_threshold", "clipped_partition_sums", "pgms"]

METHODS = ("mg", "mgn", "mgna")


def _check(method: str, alpha: int) -> None:
    if method not in METHODS:
        raise InvalidArgumentError(f"method={method!r} is unknown; pass one of {', '.join(METHODS)}.")
    if alpha not in (1, 2):
        raise InvalidArgumentError(f"alpha={alpha!r} (the norm order) is not supported; pass 1 or 2.")


def clip_threshold(method: str, alpha: int, clip: float, sizes: list[int]) -> float:
    _check(method, alpha)
    if method == "mg":
        return float(clip)
    return float(clip) / (sum(sizes) / len(sizes)) ** (1.0 / alpha)


def sensitivity(method: str, alpha: int, clip: float, sizes: list[int]) -> float:
    """Lemma 3: ℓ2 sensitivity of the vector of PGMs over the partitions with these sizes."""
    _check(method, alpha)
    if method == "mg":
        return float(clip) / min(sizes) ** (1.0 / alpha)
    return clip_threshold(method, alpha, clip, sizes)


def _pieces(part) -> list:
    return [part] if isinstance(part, torch.Tensor) else list(part)


def _transform(x: torch.Tensor, scale: float, absolute: bool) -> torch.Tensor:
    x = x * scale if scale != 1.0 else x
    return x.abs() if absolute else x


def _norm_contrib(piece, alpha: int, scale: float) -> torch.Tensor:
    """Per-sample Σ|x|^α of the scaled piece: (B,)."""
    if isinstance(piece, RowSparse):
        rows = piece.values.abs().sum(1) * scale if alpha == 1 else piece.values.pow(2).sum(1) * scale**2
        return rows.new_zeros(piece.batch_size).index_add_(0, piece.sample, rows)
    return piece.abs().sum(1) * scale if alpha == 1 else piece.pow(2).sum(1) * scale**2


def _weighted_sum(piece, factor: torch.Tensor, scale: float, absolute: bool) -> torch.Tensor:
    if isinstance(piece, RowSparse):
        vals = _transform(piece.values, scale, absolute) * factor[piece.sample].unsqueeze(1).to(piece.values.dtype)
        out = vals.new_zeros(piece.num_rows, vals.shape[1])
        return out.index_add_(0, piece.row, vals).flatten()
    return factor.to(piece.dtype) @ _transform(piece, scale, absolute)


def clipped_partition_sums(grads: list, method: str, alpha: int, clip: float, sizes: list[int]) -> list[torch.Tensor]:
    """Σ_x of the transformed, clipped per-example gradients, one flat vector per partition.

    ``grads``: per partition, a (B, |P_i|) tensor of per-example gradients, or a list of
    pieces in parameter order, each a (B, n) tensor or a
    :class:`~dpzoo.grad_norms.reps.RowSparse` embedding gradient."""
    _check(method, alpha)
    scales = [1.0 if method == "mg" else 1.0 / float(n) ** (1.0 / alpha) for n in sizes]
    absolute = method == "mgna"
    parts = [_pieces(g) for g in grads]
    total = sum(_norm_contrib(pc, alpha, sc) for ps, sc in zip(parts, scales) for pc in ps)
    norms = total if alpha == 1 else total.sqrt()
    thr = clip_threshold(method, alpha, clip, sizes)
    factor = (thr / norms.clamp_min(1e-30)).clamp(max=1.0)
    return [torch.cat([_weighted_sum(pc, factor, sc, absolute) for pc in ps]) for ps, sc in zip(parts, scales)]


def pgms(sums: list[torch.Tensor], method: str, alpha: int, sizes: list[int]) -> torch.Tensor:
    """The (noise-free) PGMs from the clipped sums (Def. 8)."""
    norms = torch.stack([s.norm(p=alpha) for s in sums])
    if method == "mg":
        norms = norms / torch.tensor([float(n) for n in sizes], dtype=norms.dtype) ** (1.0 / alpha)
    return norms


def partition_grads(per_sample: dict, partitions: list[Partition]) -> list[list]:
    """Per partition, its parameters' per-sample gradients in order: (B, n) tensors, or
    :class:`RowSparse` for embeddings (from ``NormHooks.per_sample_grads(row_sparse=True)``)."""
    return [[g if isinstance(g := per_sample[n], RowSparse) else g.flatten(1) for n in p.params] for p in partitions]
