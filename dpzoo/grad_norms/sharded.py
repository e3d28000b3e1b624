"""Sharded parameters in the norm hooks: which tensor stands in for a parameter during a pass.

Under FSDP2 (``torch.distributed.fsdp.fully_shard``) a module's registered parameter is a
DTensor shard between passes; before the module's forward (and again before its backward) FSDP
all-gathers it and registers its *unsharded* parameter in its place, and autograd's graph holds
that unsharded tensor, not the DTensor the hooks planned with. The hooks therefore accept, as
the planned parameter, a plain tensor of the planned DTensor's global shape found in its slot
during a pass (:func:`stands_in`), note it in the step (:func:`note_alias`) and map it back to
the planned parameter wherever the graph or a record is compared with the plan (:func:`planned`,
:func:`aliases_of`): the graph audit, the assembly, and ghost differentiation's targets for
bias-only layers. Any other swap (``functional_call``, a parametrization) is still refused.
"""

from __future__ import annotations

import torch
from torch import nn

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = ()  # type: ignore[assignment,misc]

__all__ = ["is_dtensor", "stands_in", "note_alias", "planned", "aliases_of"]


def is_dtensor(t) -> bool:
    """True for a torch DTensor (a sharded or replicated distributed tensor)."""
    return bool(DTensor) and isinstance(t, DTensor)


def stands_in(plan_tensor, now) -> bool:
    """True when ``now`` is FSDP2's unsharded parameter in the slot of the planned DTensor
    ``plan_tensor``: a plain parameter of the same global shape."""
    return (
        is_dtensor(plan_tensor)
        and isinstance(now, nn.Parameter)
        and not is_dtensor(now)
        and tuple(now.shape) == tuple(plan_tensor.shape)
    )


def note_alias(aliases: dict, plan_tensor, now) -> bool:
    """Record ``now`` as standing in for ``plan_tensor`` in ``aliases`` (id(now) -> (now,
    plan_tensor)); True the first time this tensor is recorded."""
    if id(now) in aliases:
        return False
    aliases[id(now)] = (now, plan_tensor)
    return True


def planned(aliases: dict, t: torch.Tensor) -> torch.Tensor:
    """The planned parameter ``t`` stands in for (``t`` itself when it is no stand-in)."""
    hit = aliases.get(id(t))
    return hit[1] if hit is not None and hit[0] is t else t


def aliases_of(aliases: dict, plan_tensor) -> list[torch.Tensor]:
    """The tensors recorded as standing in for ``plan_tensor``."""
    return [now for now, p in aliases.values() if p is plan_tensor]
