"""A PEFT adapter's privacy record beside its files: ``PeftModel.save_pretrained`` writes it,
``PeftModel.from_pretrained`` / ``load_adapter`` read it back onto the adapter.

PEFT keeps no trace of where an adapter was loaded from, so the record travels as a file: each
adapter directory ``save_pretrained`` writes gets ``dpzoo_privacy.json`` with what the adapter's
saved tensors carry (:func:`adapter_record`: the spending links on its LoRA factors, its
``modules_to_save`` copies and, with PEFT's ``bias=``, the biases it saves; each run's steps
once; ε at the smallest δ of the runs that trained it). No record is written for an adapter that
carries nothing (a stale one is removed), one whose δ is unknown (trained by Opacus), or one
partly of unknown origin; weights of unknown origin stated disjoint for a run are noted
(``unknown_origin``), so a reload is refused as the model in memory is.

A load links the record to the modules whose tensors it replaced (:func:`snapshot`,
:func:`loaded_modules`: an adapter file loaded into an existing adapter leaves the other layers
as they were), composed with a base layer's own link where only its bias was loaded. Without a
record, what it replaced is of unknown origin (:func:`flag_loaded_without_record`), refused by
a later run until the user states where it came from.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from torch import nn

from .peft_adapters import holders

__all__ = ["adapter_record", "write_adapter_records", "attach_adapter_record", "snapshot", "loaded_modules"]
__all__ += ["flag_loaded_without_record"]


def _adapter_modules(model: nn.Module, adapter: str) -> list[tuple[str, nn.Module, bool]]:
    """(name, module, own) of every module whose tensors PEFT saves for ``adapter``; ``own``: all
    of its tensors are the adapter's (its factors, its modules_to_save copy), not only a bias."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    configs = getattr(model, "peft_config", None) or {}
    bias = getattr(configs.get(adapter), "bias", "none")
    out: list[tuple[str, nn.Module, bool]] = []
    seen: set[int] = set()
    for name, m in model.named_modules():
        found: list[tuple[nn.Module, bool]] = []
        if isinstance(m, BaseTunerLayer):
            found += [(h, True) for h in holders(m, adapter)]
            if bias != "none":  # PEFT saves the adapted layers' biases ("all": every bias, below)
                found += [(b, False) for b in [getattr(m, "base_layer", None)] if b is not None]
        copies = getattr(m, "modules_to_save", None)  # ModulesToSaveWrapper: the adapter's trained copy
        if isinstance(copies, nn.ModuleDict) and adapter in copies:
            found += [(c, True) for c in copies[adapter].modules()]
        if bias == "all" and isinstance(getattr(m, "bias", None), nn.Parameter):
            found.append((m, False))
        for f, own in found:
            if id(f) not in seen:
                seen.add(id(f))
                out.append((name, f, own))
    return out


def _deltas(link) -> list[float]:
    """The δs of the runs a link stands for (an engine's accountant keeps its run's δ)."""
    out = [d for d in (getattr(getattr(link, "accountant", None), "dpzoo_delta", None), getattr(link, "delta", None))
           if isinstance(d, float)]  # fmt: skip
    for sub in [getattr(link, "source", None), getattr(link, "earlier", None), *(getattr(link, "parts", None) or [])]:
        if sub is not None:
            out += _deltas(sub)
    return out


def adapter_record(model: nn.Module, adapter: str) -> dict[str, Any] | None:
    """The privacy record of ``adapter``'s saved tensors in the PEFT model ``model``: everything
    their spending links stand for, each run's steps once, ε at the smallest δ of those runs.
    None when they carry nothing, or no run's δ is known."""
    from ..integrations.peft_statements import STATED_DISJOINT, UNKNOWN_ORIGIN
    from ..privacy.accounting.accountant import Accountant
    from ..privacy.provenance import distinct_histories, link_parts, steps_of
    from ..privacy.spending import SpendingLink
    from .peft_adapters import partly_unknown

    if any(partly_unknown(layer, adapter) for layer in model.modules()) or _unknown_part(model, adapter):
        return None  # (partly) of unknown origin: no record could hold it; refused on reload
    parts, deltas, names = [], [], []
    modules = _adapter_modules(model, adapter)
    for _, m, _own in modules:
        link = m.__dict__.get("dpzoo_spending")
        if isinstance(link, SpendingLink):
            parts += link_parts(link)
            deltas += _deltas(link)
            names += [getattr(getattr(link, "accountant", None), "name", None)]
    composed = distinct_histories(parts)
    if not composed or not deltas:
        return None
    delta = min(deltas)
    name = next((n for n in names if isinstance(n, str)), "prv")
    record: dict[str, Any] = {
        "epsilon": float(Accountant(name, list(composed)).get_epsilon(delta)),
        "delta": delta,
        "accountant": name,
        "steps": steps_of(composed),
        "sample_rate": max(float(h[1]) for h in composed),
        "history": [list(h) for h in composed],
        "run_id": uuid.uuid4().hex,  # every step is in composed_runs' runs: this record adds none
        "composed_runs": composed.segments,
    }
    if any(m.__dict__.get(STATED_DISJOINT) for m in model.modules()):  # anywhere: its layers, holders, the model
        record["unknown_origin"] = UNKNOWN_ORIGIN
    return record


def _unknown_part(model: nn.Module, adapter: str) -> bool:
    """Some of the adapter's saved tensors are of unknown origin (loaded without a record, not trained since)."""
    from .peft_adapters import trained_adapters

    if any(a == adapter for _, a in trained_adapters(model)):
        return True
    return any(m.__dict__.get("dpzoo_loaded_without_record") for _, m, _ in _adapter_modules(model, adapter))


def write_adapter_records(model: nn.Module, save_directory, adapters: list[str]) -> None:
    """Beside each adapter PEFT saved (``default`` in ``save_directory``, others in a folder of
    their name), its record; a stale one is removed where the adapter carries nothing."""
    from .trainer_save import write_privacy_files

    for adapter in adapters:
        directory = Path(save_directory) if adapter == "default" else Path(save_directory) / adapter
        if directory.is_dir():
            write_privacy_files(model, directory, adapter_record(model, adapter), zoo_files=False)


def snapshot(model: nn.Module, adapter: str) -> dict[int, tuple]:
    """What the modules holding ``adapter``'s saved tensors hold now (parameter identities and
    versions), to tell afterwards which ones a load replaced."""
    return {id(m): _state(m, own) for _, m, own in _adapter_modules(model, adapter)}


def _state(m: nn.Module, own: bool) -> tuple:
    """Each tensor's identity and two float64 sums (a hot swap writes through ``.data``, which no
    version counter sees); of a layer whose bias alone the adapter saves, the bias."""
    import torch

    tensors = list(m.parameters(recurse=False)) if own else [b for b in [getattr(m, "bias", None)] if b is not None]
    with torch.no_grad():  # a meta tensor (PEFT's low_cpu_mem_usage) holds nothing yet: any load replaces it
        return tuple((id(p), "meta") if p.is_meta else (id(p), float(p.double().sum()), float(p.double().abs().sum()))
                     for p in tensors)  # fmt: skip


def loaded_modules(model: nn.Module, adapter: str, before: dict[int, tuple]) -> set[int]:
    """Ids of the modules whose tensors a load of ``adapter`` replaced (new, or written into):
    PEFT loads an adapter file into an existing adapter layer by layer, leaving the others."""
    return {id(m) for _, m, own in _adapter_modules(model, adapter) if before.get(id(m)) != _state(m, own)}


def flag_loaded_without_record(model: nn.Module, adapter: str, only: set[int]) -> None:
    """Mark what a load replaced without a record as of unknown origin: the adapter's factors
    (:func:`~dpzoo.integrations.peft_adapters.flag_loaded_unknown`), and its ``modules_to_save``
    copies and biases (their links dropped where all their tensors were replaced)."""
    from .peft_adapters import LOADED_OTHER, flag_loaded_unknown
    from .peft_layers import lora_layers

    lora_factors = {id(h) for layer in lora_layers(model).values() for h in holders(layer, adapter)}
    flag_loaded_unknown(model, adapter, only & lora_factors)  # told trained from fresh by their ΔW
    for _, m, own in _adapter_modules(model, adapter):
        if id(m) in only and id(m) not in lora_factors and any(True for _ in m.parameters(recurse=False)):
            if own:
                m.__dict__.pop("dpzoo_spending", None)
            object.__setattr__(m, LOADED_OTHER, True)


def attach_adapter_record(
    model: nn.Module, model_id, adapter: str, subfolder: str | None = None, only: set[int] | None = None
) -> bool:
    """After PEFT loaded ``adapter`` from ``model_id`` (a local directory): link its record, if
    the directory has one, to the adapter's tensors, so a later run composes it (on a layer whose
    bias alone it loaded, composed with what the layer carried). Whether it linked one."""
    from ..errors import PrivacyUsageError
    from ..hub.saved_files import read_privacy_metadata
    from ..integrations.peft_statements import STATED_DISJOINT
    from ..privacy.provenance import record_parts
    from ..privacy.spending import ComposedSpending, RecordSpending, SpendingLink

    directory = Path(os.fspath(model_id)) / (subfolder or "")
    record = read_privacy_metadata(directory) if directory.is_dir() else None
    if not record:
        return False
    try:
        parts = record_parts(record)
    except PrivacyUsageError:  # no σ to compose with: left of unknown origin, refused by name
        return False
    for _, m, own in _adapter_modules(model, adapter):
        if (only is None or id(m) in only) and any(True for _ in m.parameters(recurse=False)):
            m.__dict__.pop("dpzoo_loaded_without_record", None)
            link = RecordSpending(parts, float(record["delta"]))
            earlier = m.__dict__.get("dpzoo_spending")
            if not own and isinstance(earlier, SpendingLink):  # its weight is still the base's
                link = ComposedSpending([earlier, link])
            object.__setattr__(m, "dpzoo_spending", link)
            if record.get("unknown_origin"):
                object.__setattr__(m, STATED_DISJOINT, True)
    return True
