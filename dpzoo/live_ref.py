"""A weak reference a model keeps to the live object that instruments it (its engine, its norm
hooks): shared by ``copy.deepcopy`` (an EMA / SWA copy points at the same engine) and dropped by
``pickle`` / ``torch.save`` (those objects live in this process only), where a bare
``weakref.ref`` makes pickling the model fail."""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["LiveRef"]


class LiveRef:
    """``LiveRef(obj)()`` is ``obj`` while it lives, else None; None after unpickling."""

    def __init__(self, obj: Any):
        self._ref = weakref.ref(obj) if obj is not None else None

    def __call__(self) -> Any:
        return self._ref() if self._ref is not None else None

    def __deepcopy__(self, memo: dict) -> "LiveRef":
        return self

    def __reduce__(self):
        return (LiveRef, (None,))
