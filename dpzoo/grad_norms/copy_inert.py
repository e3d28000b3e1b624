"""Hooks that a deep copy of the model does not carry.

``copy.deepcopy(model)`` after ``make_private`` (an EMA or SWA of the released iterates:
``torch.optim.swa_utils.AveragedModel``, timm's ``ModelEmaV3``) copies the module's hook
dictionaries. dpzoo's hooks are bound to the engine's recorder and optimizer, so the copy either
failed (deep-copying the optimizer) or would record into the live step. Each hook dpzoo registers
is wrapped in :class:`CopyInert`, whose deep copy is a hook that does nothing: the copy is a plain
model computing the same function, and averaging released iterates is post-processing. A pickled
model (``torch.save(model)`` with the hooks attached) gets the same: its hooks load as :func:`inert`
(the spending link travels with it, with its run id).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

__all__ = ["CopyInert", "inert"]


def inert(*args: Any, **kwargs: Any) -> None:
    """The hook a copied model gets: changes nothing."""
    return None


class CopyInert(functools.partial):
    """``fn`` as a hook; ``copy.deepcopy`` of it (with its module) is :func:`inert`. A partial with
    no bound arguments: calling it calls ``fn`` from C, no Python frame of its own (a hook of every
    hooked layer's call, hundreds a step, each a frame on the host a GPU waits for)."""

    __slots__ = ()

    def __new__(cls, fn: Callable):
        return super().__new__(cls, fn)

    def __deepcopy__(self, memo: dict) -> Callable:
        return inert

    def __reduce__(self) -> tuple:
        return (_inert, ())


def _inert() -> Callable:
    return inert
