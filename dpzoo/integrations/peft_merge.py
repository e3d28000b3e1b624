"""A LoRA adapter merged into its base layer keeps its provenance.

PEFT's ``merge_and_unload()`` (and ``merge_adapter()`` followed by ``unload()``) adds each
adapter's ΔW to the base layer and puts the base layer back in the model. The adapter's
weights, and with them anything dpzoo could see (a trained factor that starts at zero, the
engine's spending link), are gone: an adapter DP-trained elsewhere and loaded without its record
would then start a fresh budget on the merged model. This module watches that one event, the
tuner layer being replaced in its parent, through torch's global module-registration hook:

* an adapter a dpzoo engine trained hands its :class:`~dpzoo.privacy.budget.SpendingLink` to the
  base layer, so the merged model composes that spending (also when one of its layers is reused);
* an adapter that changes the weights (a zero-started factor is not zero; or a tuner family whose
  ΔW cannot be told zero) and carries no link marks the base layer (``dpzoo_merged_adapters``):
  ``make_private`` refuses the model until its record is composed or the data are stated disjoint
  (:func:`dpzoo.privacy.budget.prior_spending`).

It is installed by ``import dpzoo``: at once if PEFT is imported, else right after PEFT's import
(a finder on ``sys.meta_path``), so ``import dpzoo`` stays free of torch. A merge done in another
process, or before dpzoo was imported, leaves no trace in memory, like any weights loaded with
``load_state_dict``; the record then has to be composed by the user (GUIDE, "Provenance").
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

__all__ = ["MARK", "install", "merged_without_record"]

MARK = "dpzoo_merged_adapters"  # attribute on a base layer: the adapters merged into it with no record
_ZERO_STARTED = ("lora_B", "lora_embedding_B", "lora_E")  # factors that start at zero (AdaLoRA: lora_E)
_installed: list[Any] = []  # the torch hook handle, once registered


def install() -> None:
    """Watch PEFT merges from now on (idempotent); defers until PEFT is imported."""
    if _installed:
        return
    if "peft" in sys.modules:
        _register()
    elif not any(isinstance(f, _AfterPeftImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterPeftImport())


def merged_without_record(module) -> list[tuple[str, str]]:
    """(layer name, adapter name) for every adapter merged into a layer of ``module`` whose
    provenance is unknown (see the module docstring)."""
    return [(name, adapter) for name, m in module.named_modules() for adapter in m.__dict__.get(MARK, ())]


class _AfterPeftImport(importlib.abc.MetaPathFinder):
    """Runs :func:`_register` right after ``import peft`` finishes, then leaves ``sys.meta_path``."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "peft":
            return None
        sys.meta_path.remove(self)  # one import to watch; the real finders find it
        spec = importlib.util.find_spec(fullname)
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
    if not _installed:
        from torch.nn.modules.module import register_module_module_registration_hook

        _installed.append(register_module_module_registration_hook(_on_child_assigned))


def _on_child_assigned(parent, name: str, value) -> None:
    """torch calls this before ``parent.<name> = value``: a PEFT tuner layer with merged adapters
    replaced by its (merged) base layer is the merge whose provenance must survive."""
    old = parent.__dict__.get("_modules", {}).get(name)
    merged = getattr(old, "merged_adapters", None)
    if value is None or old is value or not merged or hasattr(value, "merged_adapters"):
        return None
    for adapter in merged:
        link = _spending_link(old, adapter)
        if link is not None:
            if getattr(value, "dpzoo_spending", None) is None:
                object.__setattr__(value, "dpzoo_spending", link)
        elif _changes_weights(old, adapter):
            marks = value.__dict__.setdefault(MARK, [])
            if adapter not in marks:
                marks.append(adapter)
    return None


def _entry(container, adapter: str):
    """``container[adapter]`` for PEFT's per-adapter ModuleDict / ParameterDict, else None."""
    keys = getattr(container, "keys", None)
    return container[adapter] if callable(keys) and adapter in keys() else None


def _spending_link(layer, adapter: str):
    """The spending link a dpzoo engine left on the adapter's layers, if it trained them."""
    for container in layer.children():  # lora_A, lora_B, ... (a ParameterDict holds its own tensors)
        entry = _entry(container, adapter)
        holder = entry if hasattr(entry, "modules") else container
        for m in holder.modules() if entry is not None else ():
            link = getattr(m, "dpzoo_spending", None)
            if getattr(link, "history", None):
                return link
    return None


def _changes_weights(layer, adapter: str) -> bool:
    """False only when a factor that starts at zero is still zero (ΔW = 0): the adapter was never
    trained. Tuner families without such a factor are taken to change the weights."""
    entries = [e for e in (_entry(getattr(layer, a, None), adapter) for a in _ZERO_STARTED) if e is not None]
    tensors = [t for e in entries for t in (e.parameters() if hasattr(e, "parameters") else [e])]
    return not entries or any(bool(t.detach().ne(0).any()) for t in tensors)
