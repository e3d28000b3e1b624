"""A LoRA adapter merged into its base layer keeps its provenance.

PEFT's merge (``merge_and_unload()``, ``merge_adapter()``, a tuner layer's ``merge()``) adds each
adapter's ΔW to the base layer's weights. The adapter's weights, and with them anything dpzoo could
see (a trained factor, the engine's spending link), may then vanish: an adapter DP-trained elsewhere
and loaded without its record would start a fresh budget on the merged model. This module watches
the merge itself, by wrapping every PEFT tuner layer's ``merge`` / ``unmerge`` and the tuner
models' ``merge_and_unload`` / ``merge_adapter``:

* an adapter a dpzoo engine trained hands its :class:`~dpzoo.privacy.spending.SpendingLink` to the
  base layer (the longer history wins), so the merged model composes that spending;
* an adapter whose ΔW is not zero and that carries no link marks the base layer
  (``dpzoo_merged_adapters``), and a tuner model's merge writes the marks into every Hugging Face
  config of the model (``config.dpzoo_merged_adapters``), so ``save_pretrained`` /
  ``from_pretrained`` keep them. ``make_private`` and ``dpzoo.save`` refuse a marked model until
  the user states its record or that the data are disjoint (``dpzoo_privacy``, on the model or a
  module holding the layer; one ``dpzoo.load`` attached does not count), and a run that composed
  the statement clears the marks (its own spending link now covers the weights).

torch's global module-registration hook carries marks and links when a module holding them is
replaced in its parent (a tuner layer unloaded into a new module, dpzoo's own surgery).

Installed by ``import dpzoo``: at once if PEFT is imported, else right after PEFT's import
finishes (a finder on ``sys.meta_path`` that stays until then), so ``import dpzoo`` stays free of
torch. A merge done in another process, or before dpzoo was imported, leaves nothing in memory
to see, like any weights loaded with ``load_state_dict``. ``PeftModel.save_pretrained`` and
``load_adapter`` (which ``from_pretrained`` calls) are watched too: the adapter's record is
written beside it and read back (:mod:`dpzoo.integrations.peft_records`).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from typing import Any

from .after_import import when_imported
from .peft_adapters import (
    changes_weights,
    composed,
    fingerprint,
    flag_partly_unknown,
    forget_adapter,
    has_adapter,
    partly_unknown,
    set_link,
    spending_link,
)
from .peft_statements import MARK, STATED_DISJOINT, merged_without_record

__all__ = ["install"]

FINGERPRINTS = "dpzoo_merged_deltas"  # on a base layer: {adapter: fingerprint of the ΔW merged}
_installed: list[Any] = []  # the torch hook handle, once registered


def install() -> None:
    """Watch PEFT merges from now on (idempotent); defers until PEFT is imported."""
    if not _installed:
        when_imported("peft", _register)


def _register() -> None:
    if _installed:
        return
    from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
    from torch.nn.modules.module import register_module_module_registration_hook

    _installed.append(register_module_module_registration_hook(_on_child_assigned))
    for cls in _subclasses(BaseTunerLayer):
        _wrap_layer_class(cls)
    previous = BaseTunerLayer.__dict__.get("__init_subclass__")

    def init_subclass(cls, **kwargs):  # tuner layers defined later (lazily imported families)
        (previous.__func__(cls, **kwargs) if previous else super(BaseTunerLayer, cls).__init_subclass__(**kwargs))
        _wrap_layer_class(cls)

    BaseTunerLayer.__init_subclass__ = classmethod(init_subclass)  # type: ignore[assignment]
    for cls in _subclasses(BaseTuner):
        for name in ("merge_and_unload", "merge_adapter"):
            _wrap(cls, name, _after_model_merge)
    import peft

    for cls in _subclasses(peft.PeftModel) + _subclasses(peft.PeftMixedModel):
        _wrap(cls, "load_adapter", _after_load_adapter)
    _wrap(peft.PeftModel, "save_pretrained", _after_save)
    for cls in _subclasses(BaseTuner):
        _wrap(cls, "add_weighted_adapter", _after_weighted_adapter)
    hotswap = sys.modules.get("peft.utils.hotswap")
    if hotswap is None:
        try:
            import peft.utils.hotswap as hotswap
        except ImportError:  # pragma: no cover - a PEFT without hotswapping
            hotswap = None
    swap = getattr(hotswap, "hotswap_adapter_from_state_dict", None)
    if swap is not None and not getattr(swap, "dpzoo_watched", False):
        wrapped = functools.wraps(swap)(_after_hotswap(swap))
        wrapped.dpzoo_watched = True  # type: ignore[attr-defined]
        hotswap.hotswap_adapter_from_state_dict = wrapped


def _subclasses(cls) -> list:
    out, todo = [cls], [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in out:
                out.append(sub)
                todo.append(sub)
    return out


def _wrap(cls, name: str, make) -> None:
    fn = cls.__dict__.get(name)
    if fn is not None and not getattr(fn, "dpzoo_watched", False):
        wrapped = functools.wraps(fn)(make(fn))
        wrapped.dpzoo_watched = True  # type: ignore[attr-defined]
        setattr(cls, name, wrapped)


def _wrap_layer_class(cls) -> None:
    _wrap(cls, "merge", _after_merge)
    _wrap(cls, "unmerge", _after_unmerge)


def _after_merge(fn):
    def merge(self, *args, **kwargs):
        before = list(getattr(self, "merged_adapters", ()))
        out = fn(self, *args, **kwargs)
        _note_merged(self, [a for a in getattr(self, "merged_adapters", ()) if a not in before])
        return out

    return merge


def _after_unmerge(fn):
    def unmerge(self, *args, **kwargs):
        before = {a: fingerprint(self, a) for a in getattr(self, "merged_adapters", ())}
        out = fn(self, *args, **kwargs)
        base = _base_layer_of(self)
        merged = base.__dict__.get(FINGERPRINTS, {}) if base is not None else {}
        for adapter, print_ in before.items():
            # the ΔW subtracted is the one merged (PEFT re-initialising an adapter unmerges a zero ΔW)
            if (
                adapter not in getattr(self, "merged_adapters", ())
                and print_ is not None
                and merged.get(adapter) == print_
            ):
                base.__dict__[MARK] = [a for a in base.__dict__.get(MARK, []) if a != adapter]
                merged.pop(adapter)
        return out

    return unmerge


def _after_model_merge(fn):
    def method(self, *args, **kwargs):
        out = fn(self, *args, **kwargs)
        model = out if hasattr(out, "named_modules") else getattr(self, "model", None)
        if model is not None:
            _write_config_marks(model)
        return out

    return method


def _after_load_adapter(fn):
    signature = inspect.signature(fn)

    def load_adapter(self, *args, **kwargs):
        given = signature.bind(self, *args, **kwargs).arguments
        adapter, source = given.get("adapter_name"), given.get("model_id")
        if not isinstance(adapter, str):
            out = fn(self, *args, **kwargs)
            forget_adapter(self, adapter)
            return out
        from .peft_records import attach_adapter_record, flag_loaded_without_record, loaded_modules, snapshot

        before = snapshot(self, adapter)  # (imports torch: not when dpzoo is imported)
        out = fn(self, *args, **kwargs)
        loaded = loaded_modules(self, adapter, before)  # an adapter already there keeps the layers not in the file
        forget_adapter(self, adapter, loaded)
        local = isinstance(source, (str, os.PathLike))  # its record, if saved beside it
        subfolder = (given.get("kwargs") or {}).get("subfolder")
        if not (local and attach_adapter_record(self, source, adapter, subfolder, loaded)):
            flag_loaded_without_record(self, adapter, loaded)  # trained elsewhere, whatever its initialisation
        return out

    return load_adapter


def _after_save(fn):
    signature = inspect.signature(fn)

    def save_pretrained(self, *args, **kwargs):
        out = fn(self, *args, **kwargs)
        given = signature.bind(self, *args, **kwargs).arguments
        if given.get("is_main_process", True):
            from .peft_records import write_adapter_records

            adapters = given.get("selected_adapters") or list(self.peft_config)
            write_adapter_records(self, given["save_directory"], adapters)
        return out

    return save_pretrained


def _after_hotswap(fn):
    signature = inspect.signature(fn)

    def hotswap(*args, **kwargs):
        bound = signature.bind(*args, **kwargs).arguments
        model, adapter = bound.get("model"), bound.get("adapter_name")
        if model is None or not isinstance(adapter, str):
            out = fn(*args, **kwargs)
            forget_adapter(model, adapter)
            return out
        from .peft_records import flag_loaded_without_record, loaded_modules, snapshot

        before = snapshot(model, adapter)
        out = fn(*args, **kwargs)
        loaded = loaded_modules(model, adapter, before)
        forget_adapter(model, adapter, loaded)
        flag_loaded_without_record(model, adapter, loaded)  # a state dict from elsewhere: no record comes with it
        return out

    return hotswap


def _after_weighted_adapter(fn):
    signature = inspect.signature(fn)

    def add_weighted_adapter(self, *args, **kwargs):
        out = fn(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs).arguments
        sources, new = list(bound.get("adapters") or []), bound.get("adapter_name")
        for layer in self.modules():  # a combination spent what its parts spent
            present = [a for a in sources if has_adapter(layer, a)]
            if not present or not has_adapter(layer, new):
                continue
            links = [link for link in (spending_link(layer, a) for a in present) if link is not None]
            if links:
                set_link(layer, new, composed(links))
            if any(spending_link(layer, a) is None and changes_weights(layer, a) for a in present):
                flag_partly_unknown(layer, new)  # a part of unknown origin: still refused until stated
        return out

    return add_weighted_adapter


def _base_layer_of(layer):
    get = getattr(layer, "get_base_layer", None)
    return get() if callable(get) else None


def _note_merged(layer, adapters: list) -> None:
    """The merged adapters' provenance, on the base layer their ΔW now lives in."""
    base = _base_layer_of(layer)
    if base is None:
        return
    for adapter in adapters:
        link = spending_link(layer, adapter)
        if link is not None:
            _give_link(base, link)
        if (link is None or partly_unknown(layer, adapter)) and changes_weights(layer, adapter):
            marks = base.__dict__.setdefault(MARK, [])
            if adapter not in marks:
                marks.append(adapter)
            base.__dict__.setdefault(FINGERPRINTS, {})[adapter] = fingerprint(layer, adapter)


def _give_link(module, link) -> None:
    """The base layer now holds the adapter's ΔW: it carries both links, composed by run (a longer
    history need not contain the other: an Opacus link holds Opacus' steps only)."""
    from .peft_adapters import composed

    mine = getattr(module, "dpzoo_spending", None)
    object.__setattr__(module, "dpzoo_spending", link if mine is None else composed([mine, link]))


def _write_config_marks(model) -> None:
    adapters = sorted({a for _, a in merged_without_record(model, configs=False)})
    if not adapters:
        return
    for m in model.modules():
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "to_json_string"):
            setattr(config, MARK, sorted(set(getattr(config, MARK, None) or []) | set(adapters)))


def _on_child_assigned(parent, name: str, value) -> None:
    """torch calls this before ``parent.<name> = value``: marks and spending links of the module
    replaced move to its replacement (a tuner layer unloaded, a layer converted by surgery)."""
    old = parent.__dict__.get("_modules", {}).get(name)
    if value is None or old is None or old is value:
        return None
    holders = [m for m in (old, _base_layer_of(old)) if m is not None and m is not value]
    if not any(MARK in m.__dict__ or "dpzoo_spending" in m.__dict__ or STATED_DISJOINT in m.__dict__ for m in holders):
        return None
    if any(m is old for m in value.modules()):  # old is wrapped, not replaced (a tuner layer around it)
        return None
    for m in holders:
        for adapter in m.__dict__.get(MARK, ()):
            marks = value.__dict__.setdefault(MARK, [])
            if adapter not in marks:
                marks.append(adapter)
        if m.__dict__.get(STATED_DISJOINT):  # weights of unknown origin a run was told were disjoint: still unknown
            object.__setattr__(value, STATED_DISJOINT, True)
        link = m.__dict__.get("dpzoo_spending")
        if getattr(link, "history", None):
            _give_link(value, link)
    return None
