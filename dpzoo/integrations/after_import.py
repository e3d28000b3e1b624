"""Run a callback once a module has been imported, without importing it: what lets ``import dpzoo``
install its watches on PEFT and transformers while staying free of torch.

:func:`when_imported` calls the callback at once if the module is already imported, else puts a
finder on ``sys.meta_path`` that wraps the module's loader, so the callback runs right after the
module's code. A probe (``importlib.util.find_spec``, as transformers' ``is_peft_available``
does) only finds the spec and leaves the finder in place; the finder removes itself once it ran.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Callable

__all__ = ["when_imported"]


def when_imported(name: str, callback: Callable[[], None]) -> None:
    """``callback()`` now if ``name`` is imported, else right after its import (once per name)."""
    if name in sys.modules:
        callback()
    elif not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, callback))


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, callback: Callable[[], None]):
        self.name, self.callback, self.searching = name, callback, False

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name or self.searching:
            return None
        self.searching = True  # the real finders, not this one, find the spec
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.searching = False
        if spec is not None and spec.loader is not None:
            spec.loader = _RunAfter(spec.loader, self)
        return spec


class _RunAfter(importlib.abc.Loader):
    def __init__(self, loader, finder: _AfterImport):
        self.loader, self.finder = loader, finder

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self.finder]
        self.finder.callback()
