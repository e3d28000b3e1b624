"""What a model carries of earlier DP runs, composed each run's steps once, and the checks that
keep it from being lost.

:func:`prior_spending` composes what a new run must count first: every spending link
(:mod:`dpzoo.privacy.spending`), the records ``dpzoo.load`` attached, the records of reloaded
Hugging Face models (a config's, its directory's), and what the user stated for weights of
unknown origin. :func:`link_spending` leaves the new run's links and, on each Hugging Face model
that trains, a :class:`LiveRecord` that ``save_pretrained`` writes. :func:`refuse_uncounted_spending`
keeps a saved record from leaving any of it out; :func:`refuse_shared_config` a config object two
models share from carrying one's record for both.
"""

from __future__ import annotations

import copy
import json
import os
import uuid
import weakref
from pathlib import Path
from typing import Mapping

from torch import nn

from ..errors import PrivacyUsageError
from ..hub.saved_files import read_privacy_metadata
from .accounting.accountant import Accountant
from .provenance import Spent, distinct_histories, history_of, link_parts, record_parts, run_id, segments_of, steps_of
from .spending import RecordSpending, SpendingLink

__all__ = [
    "LiveRecord",
    "link_spending",
    "write_live_records",
    "attach_loaded_record",
    "recorded_origins",
    "prior_spending",
    "prior_segments",
    "adapter_statements",
    "carried_parts",
    "spent_inside",
    "history_of",
    "record_parts",
    "refuse_weights_of_unknown_origin",
    "refuse_uncounted_spending",
    "refuse_shared_config",
    "stated_assumptions",
]


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


class LiveRecord(dict):
    """``config.dpzoo_privacy`` of a Hugging Face model (or one inside a model) a dpzoo engine
    trained: a dict that is, whenever read, copied or pickled, the record of everything the
    model's modules carry, each run's steps once. So ``save_pretrained`` (whose ``to_dict``
    deep-copies the config) writes the spending at that moment: an EMA copy's (a deep copy of the
    model gets a record of the copy), Opacus' steps after a dpzoo run's, a run on data stated
    disjoint and the run before it."""

    def __init__(self, module: nn.Module, accountant_name: str, base: list, *, now: bool = True):
        super().__init__()
        self.owners, self.name, self.key = [weakref.ref(module)], accountant_name, uuid.uuid4().hex
        self.base = base  # the plain records the config held before (a reload's): they count too
        if now:  # (not for a copy being built: its modules are not there yet)
            self.current()

    @staticmethod
    def replacing(config, module: nn.Module, accountant_name: str, ran: bool = False) -> "LiveRecord":
        """The live record for ``config`` (of ``module``), keeping the records it held before and
        the models it was the record of (a later run on a part of the model, or on the model around it).
        ``ran``: a run made it, which the records' weights of unknown origin did not stop (a statement
        covered them: ``{}`` marks the model again, which the record then says)."""
        old = getattr(config, "dpzoo_privacy", None)
        if ran and isinstance(old, dict) and not isinstance(old, LiveRecord) and "unknown_origin" in old:
            old = {k: v for k, v in old.items() if k != "unknown_origin"}
        if isinstance(old, LiveRecord):
            if not any(ref() is module for ref in old.owners):
                old.owners.append(weakref.ref(module))
            return old
        return LiveRecord(module, accountant_name, [old] if isinstance(old, dict) and old else [])

    def module(self) -> nn.Module | None:
        """The outermost live model this is the record of."""
        alive = [m for m in (ref() for ref in self.owners) if m is not None]
        return next((m for m in alive if not any(o is not m and _contains(o, m) for o in alive)), None)

    def current(self) -> dict:
        alive = [m for m in (ref() for ref in self.owners) if m is not None]
        if alive:
            parts = [p for m in alive for p in carried_parts(m, statements=False)]
            composed = distinct_histories(parts + [p for r in self.base for p in record_parts(r)])
            self.clear()  # ``run_id`` names this record; every step is in ``composed_runs``' runs
            self.update(accountant=self.name, history=list(composed), run_id=self.key, composed_runs=composed.segments)
            from ..integrations.peft_statements import unknown_origin_note

            note = next((n for n in map(unknown_origin_note, alive) if n), None)
            note = note or next((r["unknown_origin"] for r in self.base if r.get("unknown_origin")), None)
            if note:
                self["unknown_origin"] = note
        return {k: dict.__getitem__(self, k) for k in dict.__iter__(self)}  # stored items (dict(self) calls keys())

    def __deepcopy__(self, memo: dict):
        copies = [memo[id(m)] for m in (ref() for ref in self.owners) if m is not None and id(m) in memo]
        if not copies:  # not a copy of the model: its record now
            return copy.deepcopy(self.current(), memo)
        record = LiveRecord(copies[0], self.name, list(self.base), now=False)  # the copy's record, live
        record.owners += [weakref.ref(m) for m in copies[1:]]
        dict.update(record, self.current())  # until the copy is complete (or if only its config is kept)
        return record

    def __reduce__(self):
        return (dict, (self.current(),))

    def __getitem__(self, key):
        return self.current()[key]

    def get(self, key, default=None):
        return self.current().get(key, default)

    def __iter__(self):
        return iter(self.current())

    def __len__(self) -> int:
        return len(self.current())

    def __contains__(self, key) -> bool:
        return key in self.current()

    def keys(self):
        return self.current().keys()

    def items(self):
        return self.current().items()

    def values(self):
        return self.current().values()


def link_spending(module: nn.Module, accountant: Accountant) -> None:
    """Record on ``module`` and on each of its layers with trainable parameters that ``accountant``
    holds their spending (``dpzoo_spending``), and on a Hugging Face model that trains (or one
    inside) its :class:`LiveRecord` as ``config.dpzoo_privacy`` (``save_pretrained`` writes it into
    config.json, so a ``from_pretrained`` of any copy of the weights composes it). A run on data
    stated disjoint (``dpzoo_privacy = {}``) did not compose what the model carried: the links keep
    it for later runs (``kept``), and the statement, made for this run, is cleared."""
    from ..integrations.peft_statements import clear_marks, disjoint_statement, unknown_weights, use

    disjoint = disjoint_statement(module)
    kept = carried_parts(module, statements=False) if disjoint else None
    unknown = unknown_weights(module)  # before this run links them: a {} statement covered them
    for m in module.modules():  # the model, and every layer it trains (a layer can be reused elsewhere)
        if m is not module and not any(p.requires_grad for p in m.parameters(recurse=False)):
            continue
        link = getattr(m, "dpzoo_spending", None)
        m.__dict__.pop("dpzoo_loaded_without_record", None)  # this run was allowed on it: statements cover it
        if isinstance(link, SpendingLink):  # updated, not replaced: the deep copies that follow it follow along
            link.relink(accountant)
        else:
            link = SpendingLink(accountant)
            object.__setattr__(m, "dpzoo_spending", link)
        if kept:
            link.kept = kept
    if disjoint:
        use(module.__dict__.pop("dpzoo_privacy"))  # for this run: a copy made before it shares the object
    write_live_records(module, accountant.name)
    clear_marks(module, unknown, disjoint)  # this spending covers what was stated; {} leaves the weights unknown


def write_live_records(module: nn.Module, accountant_name: str) -> None:
    """A :class:`LiveRecord` on the config of ``module`` and of each Hugging Face model inside that
    trains (a backbone is saved on its own too: ``backbone.save_pretrained``; a frozen one spent
    nothing)."""
    seen: set[int] = set()
    for m in module.modules():  # outermost first: inner modules often keep the same config (GPT-2's attention)
        config = getattr(m, "config", None)
        trains = m is module or any(p.requires_grad for p in m.parameters())
        if trains and config is not None and hasattr(config, "to_json_string") and id(config) not in seen:
            seen.add(id(config))
            config.dpzoo_privacy = LiveRecord.replacing(config, m, accountant_name, ran=True)


def attach_loaded_record(model: nn.Module, record: Mapping) -> None:
    """What ``dpzoo.load`` attaches for a saved record: ``model.dpzoo_privacy`` (a
    :class:`~dpzoo.hub.privacy_record.LoadedRecord`, what a re-save records) and a
    :class:`~dpzoo.privacy.spending.RecordSpending` link (kept when the user states ``{}`` there).
    A record without σ gets no link: a later run refuses it by name."""
    from ..hub.privacy_record import LoadedRecord

    model.dpzoo_privacy = LoadedRecord(record)
    from ..integrations.peft_statements import mark_unknown_origin

    mark_unknown_origin(model, [record])
    try:
        parts = record_parts(record)
    except PrivacyUsageError:
        return
    for m in model.modules():  # every layer, as a run links them: a layer reused elsewhere keeps it
        if m is model or any(True for _ in m.parameters(recurse=False)):
            object.__setattr__(m, "dpzoo_spending", RecordSpending(parts))


def recorded_origins(module: nn.Module) -> list[dict]:
    """Every record the Hugging Face models inside ``module`` were reloaded with (two reloaded
    models combined in one carry two): per config, the dpzoo record of the directory it was read
    from, the record of that directory's ``config.json`` (a config given to ``from_pretrained``
    holds none) and the record the config carries (a later ``save_pretrained`` into the same
    directory may be newer); composing them all counts each run's steps once. Of a
    :class:`LiveRecord` only the records it replaced: the rest is what the links say."""

    found: dict[int, list] = {}
    for m in module.modules():
        config = getattr(m, "config", None)
        if config is None or id(config) in found:
            continue
        path = getattr(config, "_name_or_path", None)
        directory = isinstance(path, str) and path and os.path.isdir(path)
        meta = read_privacy_metadata(path) if directory else None
        record = getattr(config, "dpzoo_privacy", None)
        records = list(record.base) if isinstance(record, LiveRecord) else [record]
        found[id(config)] = [r for r in (meta, _config_file_record(path) if directory else None, *records)
                             if isinstance(r, dict) and r]  # fmt: skip
    return [r for records in found.values() for r in records]


def _config_file_record(directory) -> dict | None:
    try:
        carried = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    record = carried.get("dpzoo_privacy") if isinstance(carried, dict) else None
    return record if isinstance(record, dict) else None


def prior_spending(module: nn.Module, earlier: Accountant | None = None) -> Spent:
    """The (σ, q, steps) history a model already spent, each run's steps once
    (:mod:`dpzoo.privacy.provenance`): ``earlier`` (an earlier engine's accountant, alive), the
    spending every earlier engine linked to it or a layer (:class:`SpendingLink`), the records
    ``dpzoo.load`` attached (the whole history when recorded, else the last σ, q and step count), the
    records Hugging Face reloads carry (:func:`recorded_origins`); none of those for a model whose
    ``dpzoo_privacy`` the user set to ``{}`` (new data disjoint from the earlier run's). Then, always,
    what the user stated for LoRA weights of unknown origin (``dpzoo_adapter_privacy`` records,
    :func:`adapter_statements`), in addition."""
    stated = adapter_statements(module)  # a statement that is not a record is refused first
    refuse_weights_of_unknown_origin(module)
    refuse_shared_config(module)
    parts = []
    from ..integrations.peft_statements import disjoint_statement

    if not disjoint_statement(module):  # {}: the user stated the new data disjoint
        if earlier is not None:
            key = run_id(earlier)
            history = [list(h) for h in earlier.history]
            parts.append((key, segments_of(key, getattr(earlier, "dpzoo_segments", None), history), history))
        parts += carried_parts(module, statements=False)
    # stated records add to the rest, never replace it: one with run ids is composed with it by run
    # (a LoRA run's record holds the base's run it composed), one without gets an id no part has
    keyed = [part for part in stated if part[0] is not None]
    out = distinct_histories(parts + keyed)
    for key, segments, history in stated:
        if key is None:
            out += history
            out.segments += [[f"stated-{uuid.uuid4().hex}", steps_of(history)]]
    return out


def prior_segments(accountant: Accountant) -> list:
    """The accountant's live list of the runs its history composed before its own steps."""
    segments = getattr(accountant, "dpzoo_segments", None)
    if segments is None:
        segments = []
        setattr(accountant, "dpzoo_segments", segments)  # Opacus accountants too: not a declared attribute
    return segments


def adapter_statements(module: nn.Module) -> list:
    """The parts (:mod:`dpzoo.privacy.provenance`) the user stated for adapters of unknown origin
    (``m.dpzoo_adapter_privacy = read_privacy_metadata(ADAPTER_DIR)`` on the model or a module
    holding them), each composed (``{}``: their data is disjoint from this run's, nothing to compose)."""
    out: list = []
    for name, m in module.named_modules():
        meta = m.__dict__.get("dpzoo_adapter_privacy")
        if meta is None:
            continue
        if not isinstance(meta, Mapping):
            raise PrivacyUsageError(
                f"{name or 'model'}.dpzoo_adapter_privacy must be a privacy record (read_privacy_metadata(DIR)) or {{}} "
                f"(data disjoint from this run's), got {type(meta).__name__}."
            )
        if meta:
            out += record_parts(meta)
    return out


def carried_parts(module: nn.Module, statements: bool = True) -> list:
    """Every run the model or a module inside it carries (a DP-trained model reused in a new one, a
    layer of it), as parts (:mod:`dpzoo.privacy.provenance`): each engine's spending link, each
    record on a module (``dpzoo_privacy``), each record a reloaded Hugging Face model carries
    (:func:`recorded_origins`), and with ``statements`` the user's adapter statements."""
    parts: list = []
    for name, m in module.named_modules():
        link = getattr(m, "dpzoo_spending", None)
        meta = m.__dict__.get("dpzoo_privacy")
        if meta is not None and not isinstance(meta, Mapping):
            raise PrivacyUsageError(
                f"{name or 'model'}.dpzoo_privacy must be a privacy record (read_privacy_metadata(DIR)) or {{}} "
                f"(new data disjoint from the earlier run's), got {type(meta).__name__}."
            )
        if isinstance(link, SpendingLink):
            parts += link_parts(link)
        if meta:
            parts += record_parts(meta)
    parts += [part for r in recorded_origins(module) for part in record_parts(r)]
    return parts + (adapter_statements(module) if statements else [])


def spent_inside(module: nn.Module) -> Spent:
    """What the model or any module inside it spent, each run's steps once (:func:`carried_parts`)."""
    return distinct_histories(carried_parts(module, statements=False))


def refuse_weights_of_unknown_origin(module: nn.Module, stated_disjoint: bool = True) -> None:
    """Trained LoRA weights no record accounts for: an adapter trained before (a factor that starts
    at zero is not) with no engine's link, and adapters merged into a layer without one
    (:mod:`dpzoo.integrations.peft_merge`). PEFT's from_pretrained keeps no trace of the directory
    a DP run saved the adapter to, and its merge none of the adapter, so the user says which
    applies, on the model or on the module that holds them; refused otherwise, whatever else the
    model carries. ``stated_disjoint=False``: not the weights stated disjoint for an earlier run
    (a save, whose record says so: ``unknown_origin``)."""
    from ..integrations.peft_statements import refuse_unknown_origin, unknown_weights

    unknown = unknown_weights(module, stated_disjoint)
    if unknown:
        refuse_unknown_origin(module, unknown)


def stated_assumptions(module: nn.Module) -> list[str]:
    """What the user stated about data outside ε, for the privacy metadata: public data behind an
    adapter's initialisation, that a model trained before saw other data (dpzoo_privacy = {}), and
    that adapters of unknown origin did (dpzoo_adapter_privacy = {}, on any module)."""
    from ..integrations.peft_statements import disjoint_statement, used

    out = list(getattr(module, "dpzoo_public_init", {}).values())
    if disjoint_statement(module):
        out.append(
            "the model was trained before on data stated to be disjoint from this run's (model.dpzoo_privacy = {}): "
            "that spending is not composed"
        )
    for name, m in module.named_modules():
        if m.__dict__.get("dpzoo_adapter_privacy") == {} and not used(m.__dict__["dpzoo_adapter_privacy"]):
            out.append(
                f"LoRA weights of unknown origin in {name or 'the model'} stated to be trained on data disjoint from this "
                "run's (dpzoo_adapter_privacy = {}): their spending is not composed"
            )
    return out


def refuse_shared_config(module: nn.Module) -> None:
    """Refuse a Hugging Face config object that another live model shares, whose record
    (:class:`LiveRecord`) it holds (two models built from one config): this run would replace that
    record, and the other model's ``save_pretrained`` would then carry the wrong spending."""
    inside = {id(m) for m in module.modules()}
    for name, m in module.named_modules():
        config = getattr(m, "config", None)
        record = getattr(config, "dpzoo_privacy", None)
        owner = record.module() if isinstance(record, LiveRecord) else None
        related = owner is None or id(owner) in inside or _contains(owner, m)  # one model, or a part of it
        if not related and getattr(owner, "config", None) is config:
            raise PrivacyUsageError(
                f"{name or 'The model'}'s config object is shared with another model that a DP run trained (its record "
                "lives on that config): give each model its own config, e.g. Model(copy.deepcopy(config))."
            )


def refuse_uncounted_spending(module: nn.Module, privacy: Mapping | None) -> None:
    """Refuse to save ``module`` with the record ``privacy`` (None: none) when the model carries
    spending the record does not count (an engine that is gone, Opacus' steps after a dpzoo run's):
    a later run would compose the record only, and its ε would be too small. A record the model
    carries that cannot be composed (no σ) must be the one saved."""
    from ..integrations.peft_statements import refuse_unnoted_unknown_origin

    refuse_unnoted_unknown_origin(module, privacy)
    try:
        carried = carried_parts(module)
    except PrivacyUsageError:
        if privacy is not None and dict(privacy) == dict(module.__dict__.get("dpzoo_privacy") or {}):
            return  # the loaded record itself, saved again
        raise
    if not distinct_histories(carried):
        return
    recorded = record_parts(privacy) if privacy else []
    missing = steps_of(distinct_histories(carried + recorded)) - steps_of(distinct_histories(recorded))
    if missing > 0:
        raise PrivacyUsageError(
            f"This model carries {missing} DP step(s) its {'privacy record' if privacy else 'save (no privacy record)'} "
            "does not count, so a later run would compose too little: save while the engine that trained it last is "
            "attached (dpzoo.save takes its record), or pass privacy=engine.privacy_metadata() of that engine."
        )
