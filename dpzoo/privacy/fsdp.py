"""DP training of a model sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``): what the
engine accepts, and how the private gradient reaches the shards.

Design (docs/DESIGN.md, "FSDP2"):

* each rank computes the per-sample norms of its own samples: the norm hooks record the
  activations and output gradients of its batch, with the unsharded parameters FSDP gathers
  for each module's forward and backward standing in for the sharded ones
  (:mod:`dpzoo.grad_norms.sharded`); a sample's norm is summed over all layers locally, so it
  needs no communication;
* ghost differentiation computes no weight gradient, so FSDP's own reduce-scatter has nothing
  to reduce; a gradient that reaches a parameter anyway (a use outside the model) is refused at
  the step, as without FSDP (FSDP's gradient sync is left on so it cannot hide in an unsharded
  ``.grad``);
* the clipped sum of each parameter is formed full-size on every rank from its own samples,
  reduce-scattered to the owners of the rows (:meth:`ShardedGrads.sharded`), and each rank adds
  N(0, σ²R²) to the rows it owns: every coordinate is noised exactly once. With ``noise_seed``
  every rank draws the full-size noise from the shared generator and keeps its rows, so the
  update equals the single-process one bit for bit (tests); secret noise is drawn per shard;
* the reduction runs in the sharded parameter's dtype (fp32 master weights under a
  ``MixedPrecisionPolicy(param_dtype=bfloat16)``), norms in fp32 or better.

Every rank must run the same passes (FSDP's all-gathers are collective), so under FSDP2 an
empty Poisson batch is yielded (0 rows, a noise-only step after its forward/backward) instead of
being stepped by the loader, and ``max_physical_batch_size`` (a rank-dependent number of
micro-batches) is refused, as are the first-step self-check (its single-sample reference passes
would be rank-dependent collectives), FSDP1, tensor parallelism and HSDP (:func:`check_sharding`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import PrivacyUsageError, UnsupportedModuleError
from ..grad_norms.rounding import mechanism_dtype
from ..grad_norms.sharded import is_dtensor
from .data import secret_generator
from .distributed import flat_noise, world_and_rank

if TYPE_CHECKING:
    from .optimizer import DPOptimizer

__all__ = ["is_fsdp2", "check_sharding", "check_fsdp_settings", "ShardedGrads"]


def _fsdp_module_type():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return None
    return FSDPModule


def _fsdp1_type():
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover
        return None
    return FullyShardedDataParallel


def is_fsdp2(module: nn.Module) -> bool:
    """True when ``module`` or a submodule was sharded with ``fully_shard``."""
    cls = _fsdp_module_type()
    return cls is not None and any(isinstance(m, cls) for m in module.modules())


def check_sharding(module: nn.Module) -> bool:
    """Refuse the distributed layouts dpzoo cannot clip and noise correctly; True for an FSDP2
    model dpzoo supports (every DTensor parameter sharded by ``fully_shard`` along dim 0 over
    one 1-D mesh spanning the whole process group)."""
    fsdp1 = _fsdp1_type()
    if fsdp1 is not None and any(isinstance(m, fsdp1) for m in module.modules()):
        raise UnsupportedModuleError(
            "FSDP1 (FullyShardedDataParallel) is not supported: its flat parameters hide the per-layer tensors "
            "dpzoo clips. Shard with FSDP2 instead (torch.distributed.fsdp.fully_shard per block and at the root)."
        )
    dtensors = [(n, p) for n, p in module.named_parameters() if is_dtensor(p)]
    if not dtensors:
        return False
    if not is_fsdp2(module):
        raise UnsupportedModuleError(
            f"Parameter {dtensors[0][0]} is a DTensor but no module was sharded with fully_shard: tensor parallelism "
            "(and other DTensor layouts) is not supported. Use FSDP2 (fully_shard) or a plain replicated model."
        )
    from torch.distributed.tensor import Shard

    world = dist.get_world_size() if dist.is_initialized() else 1
    for name, param in dtensors:
        p: Any = param  # a DTensor (is_dtensor)
        mesh = p.device_mesh
        if mesh.ndim != 1:
            raise UnsupportedModuleError(
                f"Parameter {name} lives on a {mesh.ndim}-D device mesh (HSDP or FSDP combined with tensor "
                "parallelism): not supported. Shard with fully_shard over a 1-D mesh of all ranks."
            )
        if tuple(p.placements) != (Shard(0),):
            raise UnsupportedModuleError(
                f"Parameter {name} has placements {tuple(p.placements)}: dpzoo supports FSDP2's Shard(0) only "
                "(no tensor parallelism, no custom shard_placement_fn). Shard with fully_shard's default placement."
            )
        if mesh.size() != world:
            raise UnsupportedModuleError(
                f"Parameter {name} is sharded over {mesh.size()} of {world} ranks: dpzoo gives every rank of the "
                "process group a shard of the data, so the mesh must span all of them (the default mesh)."
            )
    return True


def check_fsdp_settings(*, max_physical_batch_size: int | None, self_check: bool) -> None:
    """The ``make_private`` settings FSDP2 rules out (see the module docstring)."""
    if max_physical_batch_size is not None:
        raise PrivacyUsageError(
            "max_physical_batch_size is not supported under FSDP2: ranks would split their Poisson batches into "
            "different numbers of micro-batches, and FSDP's collectives need the same passes on every rank. Pass "
            "None and choose batch_size so that a rank's batch fits in memory."
        )
    if self_check:
        raise PrivacyUsageError(
            "self_check=True is not supported under FSDP2 (its single-sample reference passes would be "
            "rank-dependent collectives): pass self_check=False; the FSDP2 path is tested against the "
            "single-process engine."
        )


class ShardedGrads:
    """The DPOptimizer's gradient writer under FSDP2: ``writer(p, summed)`` is ``p``'s private
    ``.grad`` (clipped sum over all ranks + noise once per coordinate), a DTensor with ``p``'s
    placement for a sharded parameter; a replicated one is left to the optimizer's own writer."""

    def __init__(self, optimizer: DPOptimizer):
        self.optimizer = optimizer

    def __call__(self, p: torch.Tensor, summed: torch.Tensor | None) -> torch.Tensor:
        if not is_dtensor(p):
            return self.optimizer.replicated_grad(p, summed)
        return self.sharded(p, summed)

    def write_many(self, params: list, summed: list) -> list[torch.Tensor]:
        """Every parameter's ``.grad``; seeded noise drawn as one process draws it (:func:`flat_noise`:
        per device and dtype, all coordinates in order, on every rank from the shared generator),
        each sharded parameter keeping its rows, rank 0 adding a replicated one's. Seeded noise is for
        tests: every rank then holds the whole model's noise in float32 during the step."""
        opt = self.optimizer
        std = opt.noise_multiplier * opt.max_grad_norm
        if opt.noise_seed is None or std == 0:  # secret noise: each owner draws its own, in any order
            return [self(p, s) for p, s in zip(params, summed)]
        noise: list = [None] * len(params)
        for idx, flat in flat_noise(params, std, opt.generator_for):
            for i, part in zip(idx, flat.split([params[i].numel() for i in idx])):
                noise[i] = part.view(tuple(params[i].shape))
        return [
            self.sharded(p, s, z) if is_dtensor(p) else _replicated(p, s, z) for p, s, z in zip(params, summed, noise)
        ]

    def sharded(self, p, summed: torch.Tensor | None, seeded_noise: torch.Tensor | None = None) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        opt = self.optimizer
        mesh, world = p.device_mesh, p.device_mesh.size()
        group, rank = mesh.get_group(), mesh.get_local_rank()
        local_shape = tuple(p.to_local().shape)
        dtype = mechanism_dtype(p.dtype)  # float32 for half-precision shards: cast after the noise
        full = torch.zeros(p.shape, dtype=dtype, device=p.device) if summed is None else summed.to(dtype)
        rows = full.shape[0]
        chunk = -(-rows // world)  # FSDP2's Shard(0): torch.chunk's rows, the last ranks may get fewer or none
        padded = full.new_zeros((chunk * world, *full.shape[1:]))
        padded[:rows] = full
        mine = full.new_empty((chunk, *full.shape[1:]))
        dist.reduce_scatter_tensor(mine, padded.contiguous(), group=group)  # the sum over every rank's samples
        start, stop = min(rank * chunk, rows), min((rank + 1) * chunk, rows)
        mine = mine[: stop - start]
        if tuple(mine.shape) != local_shape:
            raise UnsupportedModuleError(
                f"A parameter's local shard has shape {local_shape}, not the rows {start}:{stop} of Shard(0) that "
                "dpzoo computed: an unsupported FSDP2 layout. Use fully_shard's default placement."
            )
        std = opt.noise_multiplier * opt.max_grad_norm
        if std > 0:
            if seeded_noise is not None:  # the full parameter's, drawn on every rank alike: keep my rows
                noise = seeded_noise[start:stop]
            elif opt.noise_seed is not None:  # the shared generator, in step with one process: keep my rows
                noise = torch.normal(
                    0.0, std, size=tuple(p.shape), generator=opt.generator_for(p.device), dtype=dtype, device=p.device
                )[start:stop]
            else:  # secret: this rank alone noises the rows it owns
                noise = torch.normal(
                    0.0, std, size=local_shape, generator=secret_generator(p.device), dtype=dtype, device=p.device
                )
            mine = mine + noise.to(p.device)
        mine = mine.to(p.dtype)
        return DTensor.from_local(mine.contiguous(), mesh, p.placements, shape=p.shape, stride=p.stride())


def _replicated(p: torch.Tensor, summed: torch.Tensor | None, noise: torch.Tensor) -> torch.Tensor:
    """A replicated parameter's ``.grad`` under seeded noise drawn on every rank: the sums of every
    rank all-reduced, ``noise`` (p's, from :func:`flat_noise`) added once, by rank 0."""
    world, rank = world_and_rank()
    g = torch.zeros_like(noise) if summed is None else summed.to(noise.dtype).contiguous()
    if rank == 0:
        g = g + noise
    if world > 1:
        dist.all_reduce(g)
    return g.to(p.dtype)
