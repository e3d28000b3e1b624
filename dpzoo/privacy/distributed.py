"""What training on several ranks adds: this process's rank, its shard of the dataset, and the
checks that every rank passed the same dataset and the same settings to ``make_private``."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from ..errors import PrivacyUsageError
from ..grad_norms.rounding import mechanism_dtype
from .data import dataset_fingerprint, secret_generator

__all__ = [
    "world_and_rank",
    "shard",
    "same_on_every_rank",
    "noised_all_reduce",
    "noised_all_reduce_many",
    "flat_noise",
    "RANK_SETTINGS",
]

# make_private's arguments every rank must pass alike (with the accountant and its history)
RANK_SETTINGS = ("batch_size", "noise_multiplier", "target_epsilon", "target_delta", "epochs", "max_grad_norm",
                 "clipping", "mode", "loss_reduction", "max_physical_batch_size", "self_check", "accept_large_delta",
                 "privacy_unit", "max_examples_per_user", "user_sampling")  # fmt: skip


def world_and_rank() -> tuple[int, int]:
    """``(world size, rank)`` of the initialised process group; ``(1, 0)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def shard(data_loader, n: int, world: int, rank: int) -> range:
    """This rank's shard of the one dataset every rank passes (a DistributedSampler's is
    replaced: it pads shards by repeating samples, and dpzoo samples each shard by Poisson)."""
    sampler = getattr(data_loader, "sampler", None)
    if isinstance(sampler, DistributedSampler) and (sampler.num_replicas != world or sampler.rank != rank):
        raise PrivacyUsageError(
            f"The DistributedSampler is for rank {sampler.rank} of {sampler.num_replicas} but this process is "
            f"rank {rank} of {world}: build it from the initialised process group (or pass none)."
        )
    fingerprints: list = [None] * world
    dist.all_gather_object(fingerprints, dataset_fingerprint(data_loader.dataset))
    if len(set(fingerprints)) > 1:
        raise PrivacyUsageError(
            "The ranks passed different datasets to make_private. Pass the same full dataset on every rank "
            "(with or without a DistributedSampler): dpzoo gives each rank a disjoint shard and Poisson-samples "
            "it, so each sample is counted once. Pre-sharded or overlapping datasets cannot be accounted."
        )
    return range(rank, n, world)


def same_on_every_rank(world: int, **settings) -> None:
    """Refuse ``make_private`` unless every rank passed the same ``settings`` (compared by repr)."""
    mine = {k: repr(v) for k, v in settings.items()}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    diff = sorted({k for other in gathered for k in mine if other.get(k) != mine[k]})
    if diff:
        raise PrivacyUsageError(
            f"make_private got different settings on different ranks ({', '.join(diff)}): every rank must use the "
            "same batch_size, noise, clipping bound, mode and accountant, or the reported ε holds for none."
        )


def noised_all_reduce(
    p: torch.Tensor,
    summed: torch.Tensor | None,
    std: float,
    generator: torch.Generator | None = None,
    every_rank_draws: bool = False,
) -> torch.Tensor:
    """A replicated parameter's private gradient: this rank's clipped sum (zeros if none), plus
    N(0, std²) drawn on rank 0 alone, all-reduced, so the global sum holds the noise exactly once
    per coordinate. Sum and noise are in :func:`~dpzoo.grad_norms.rounding.mechanism_dtype` (float32
    for a half-precision parameter), the result cast to the parameter's dtype. ``generator``: a seeded one for reproducible noise (None: secret, fresh OS
    entropy); ``every_rank_draws`` (reproducible noise) draws on every rank and keeps rank 0's, so
    seeded generators stay in step."""
    world, rank = world_and_rank()
    # contiguous: a collective sums storage in memory order, so two ranks holding the same values
    # in different layouts (a transposed view from one path, a fresh tensor from another) would
    # add mismatched coordinates
    dtype = mechanism_dtype(p.dtype)
    summed = None if summed is None else summed.to(dtype)
    g = None
    if std > 0 and (rank == 0 or every_rank_draws):
        noise = torch.empty(p.shape, device=p.device, dtype=dtype)  # contiguous
        noise.normal_(0.0, std, generator=generator if generator is not None else secret_generator(p.device))
        if rank == 0:  # the noise is fresh and contiguous: add the sum into it (no copy of the sum)
            g = noise if summed is None else noise.add_(summed)
    if g is None:
        g = torch.zeros(p.shape, device=p.device, dtype=dtype) if summed is None else summed.contiguous()
    if world > 1:
        dist.all_reduce(g)
    return g.to(p.dtype)


def noised_all_reduce_many(
    params: list[torch.Tensor],
    summed: list[torch.Tensor | None],
    std: float,
    generator_for: Callable[[torch.device], torch.Generator],
    every_rank_draws: bool = False,
) -> list[torch.Tensor]:
    """:func:`noised_all_reduce` of many replicated parameters at once, the same distribution and
    the same noise-once-per-coordinate: per device and dtype, one N(0, std²) draw for all their
    coordinates (:func:`flat_noise`), the clipped sums added into it by one multi-tensor add, one
    all-reduce, one cast; each gradient a view of that buffer. On a GPU each operator is a launch:
    a GPT-2 small step drew its noise in 444 operators, a parameter at a time, before 2026-11-28."""
    world, rank = world_and_rank()
    out: list = [None] * len(params)
    draws = std > 0 and (rank == 0 or every_rank_draws)
    for idx, flat in flat_noise(params, std if draws else 0.0, generator_for):
        if rank != 0 and draws:  # drawn to keep seeded generators in step: rank 0's noise alone is released
            flat.zero_()
        sizes = [params[i].numel() for i in idx]
        shaped = [_shaped(v, params[i].shape) for i, v in zip(idx, flat.split(sizes))]  # each parameter's coordinates
        adds = [(shaped[j], summed[i]) for j, i in enumerate(idx) if summed[i] is not None]
        if adds:  # element by element: a sum's memory layout does not matter
            torch._foreach_add_([v for v, _ in adds], [_like(s, v) for v, s in adds])
        if world > 1:
            dist.all_reduce(flat)
        dtype = params[idx[0]].dtype
        if dtype != flat.dtype:  # half parameters: noise and sums in float32, one cast for all
            shaped = [_shaped(v, params[i].shape) for i, v in zip(idx, flat.to(dtype).split(sizes))]
        for i, v in zip(idx, shaped):
            out[i] = v
    return out


def _shaped(part: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``part`` of a flat buffer in a parameter's ``shape``: itself for a vector (a bias, a norm's
    scale: no view operator, each one a host dispatch on a GPU)."""
    return part if part.shape == shape else part.view(shape)


def _like(summed: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """``summed`` in ``view``'s shape and dtype (no operator where they already agree; a reshape,
    never a broadcast, where the shapes differ)."""
    if summed.shape != view.shape:
        summed = summed.reshape(view.shape)
    return summed if summed.dtype == view.dtype else summed.to(view.dtype)


def flat_noise(params: list[torch.Tensor], std: float, generator_for: Callable[[torch.device], torch.Generator]):
    """Per device and dtype of ``params`` (in order of first appearance): (their indices, one flat
    buffer of N(0, std²) for all their coordinates in order, in the mechanism's dtype: zeros where
    std = 0). How seeded noise is drawn, so that every path (one process, DDP, FSDP2) draws alike."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.device, p.dtype), []).append(i)
    for (device, dtype), idx in groups.items():
        total = sum([params[i].numel() for i in idx])
        if std > 0:
            flat = torch.empty(total, device=device, dtype=mechanism_dtype(dtype))
            flat.normal_(0.0, std, generator=generator_for(device))
        else:
            flat = torch.zeros(total, device=device, dtype=mechanism_dtype(dtype))
        yield idx, flat
