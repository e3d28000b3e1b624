"""``dpzoo.save`` of a model sharded with FSDP2 (``fully_shard``): every rank takes part in
gathering the full state dict (``torch.distributed.checkpoint``'s ``get_model_state_dict`` with
``full_state_dict=True, cpu_offload=True``, a collective), rank 0 alone writes it through
``dpzoo.save`` with the engine's privacy metadata, and the other ranks wait for its outcome (a
failure on rank 0 is raised on every rank, so none hangs). ``dpzoo.load`` reads the result as it
reads any saved model: an unsharded model, to be sharded again with ``fully_shard``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from ..errors import SaveError
from ..grad_norms.sharded import is_dtensor
from ..privacy.engine import engine_of

__all__ = ["save_if_sharded", "GatheredModel"]


class GatheredModel(nn.Module):
    """What ``dpzoo.save`` writes on rank 0: the gathered full state dict of a sharded model,
    with the attributes ``dpzoo.save`` reads (its zoo config, patch report, library config)."""

    def __init__(self, model: nn.Module, state: dict[str, torch.Tensor]):
        super().__init__()
        self._state = state
        for attr in ("dpzoo_config", "dpzoo_patch_report", "dpzoo_privacy", "config", "save_pretrained"):
            if hasattr(model, attr):
                object.__setattr__(self, attr, getattr(model, attr))

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return dict(self._state)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:  # for the saved dtype
        for t in self._state.values():
            yield t  # type: ignore[misc]


def save_if_sharded(
    model: nn.Module,
    directory: str | os.PathLike,
    save: Callable[..., Path],
    privacy: Mapping[str, Any] | None,
    overwrite: bool,
) -> Path | None:
    """Save ``model`` if it has DTensor (sharded) parameters (on every rank; rank 0 writes with
    ``save``, i.e. ``dpzoo.save``); None for an unsharded model, which the caller saves itself."""
    if not any(is_dtensor(p) for p in model.parameters()):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if privacy is None:  # the engine's record, the same on every rank
        engine = engine_of(model)
        privacy = engine.privacy_metadata() if engine is not None and engine.steps > 0 else None
    failure: list[Any] = [None]
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            save(GatheredModel(model, state), directory, privacy=privacy, overwrite=overwrite)
        except BaseException as e:  # re-raised below, after the other ranks heard of it
            error, failure[0] = e, f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(failure, src=0)
    if error is not None:
        raise error
    if failure[0] is not None:
        raise SaveError(f"Rank 0 failed to save the sharded model: {failure[0]}")
    return Path(directory)
