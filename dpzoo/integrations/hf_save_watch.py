"""``save_pretrained`` writes what the model it is called on carries.

A Hugging Face model's record (``config.dpzoo_privacy``, a
:class:`~dpzoo.privacy.carried.LiveRecord`) is written by the runs that train the model, or a
module around it, and is the record of those modules. A model can also be saved that no run
wrapped as a whole: a classifier whose head alone was trained (a probe on cached features), the
body of an LM whose outer model is gone, an EMA copy of the body only. So
``PreTrainedModel.save_pretrained`` is wrapped: when the model carries spending, it becomes one
of its record's models first (``LiveRecord.replacing``), so the record it writes holds its steps.
Installed by ``import dpzoo`` once ``transformers.modeling_utils`` is imported (a finder on
``sys.meta_path`` until then), so ``import dpzoo`` stays free of torch and transformers.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys

__all__ = ["install"]

_TARGET = "transformers.modeling_utils"
_done: list[bool] = []


def install() -> None:
    """Wrap ``save_pretrained`` from now on (idempotent); defers until transformers' models load."""
    if _done:
        return
    if _TARGET in sys.modules:
        _register()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


class _AfterImport(importlib.abc.MetaPathFinder):
    searching = False

    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET or self.searching:
            return None
        self.searching = True  # the real finders, not this one, find the spec
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.searching = False
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisterAfter(spec.loader)
        return spec


class _RegisterAfter(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        _register()


def _register() -> None:
    if _done:
        return
    _done.append(True)
    from transformers.modeling_utils import PreTrainedModel

    save = PreTrainedModel.save_pretrained
    if getattr(save, "dpzoo_watched", False):
        return

    @functools.wraps(save)
    def save_pretrained(self, *args, **kwargs):
        _own_record(self)
        return save(self, *args, **kwargs)

    save_pretrained.dpzoo_watched = True  # type: ignore[attr-defined]
    PreTrainedModel.save_pretrained = save_pretrained  # type: ignore[method-assign]
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _AfterImport)]


def _own_record(model) -> None:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        return
    from ..privacy.carried import LiveRecord, carried_parts

    if carried_parts(model, statements=False):  # it spent something: its record holds it
        old = getattr(config, "dpzoo_privacy", None)
        name = old.name if isinstance(old, LiveRecord) else "rdp"  # the record's label; its history is what counts
        config.dpzoo_privacy = LiveRecord.replacing(config, model, name)
