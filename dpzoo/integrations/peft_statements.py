"""What a model states about LoRA weights of unknown origin, and the refusal until it does.

:mod:`dpzoo.integrations.peft_merge` marks the layers (and Hugging Face configs) into which PEFT
merged an adapter that no dpzoo engine trained; :func:`dpzoo.integrations.peft_adapters.trained_adapters`
finds adapters trained before and loaded without a record. Both are refused
(:func:`refuse_unknown_origin`) until the user states where the weights came from, on the model or
on a module holding them: ``dpzoo_adapter_privacy = read_privacy_metadata(ADAPTER_DIR)`` (its
spending is composed in addition to the model's own) or ``{}`` (trained on data disjoint from
this run's, recorded in the metadata); a ``dpzoo_privacy`` record the user set counts too, one
``dpzoo.load`` attached (:class:`~dpzoo.hub.privacy_record.LoadedRecord`) does not. A DP run that
composed the statement clears it and the marks (:func:`clear_marks`).
"""

from __future__ import annotations

from typing import Mapping

from ..errors import PrivacyUsageError
from ..hub.privacy_record import LoadedRecord

__all__ = ["MARK", "merged_without_record", "refuse_unknown_origin", "clear_marks", "refuse_save_of_stated_merges"]
__all__ += ["UNKNOWN_ORIGIN", "unknown_origin_note", "mark_unknown_origin", "refuse_unnoted_unknown_origin"]
__all__ += [
    "mark_weights_unknown",
    "used",
    "use",
    "disjoint_statement",
    "unknown_weights",
    "stated_disjoint_before",
    "STATED_DISJOINT",
]

MARK = "dpzoo_merged_adapters"  # on a base layer (a list) and on a Hugging Face config (a sorted list)


def merged_without_record(module, configs: bool = True) -> list[tuple[str, str]]:
    """(module name, adapter name) for every adapter merged into ``module``'s layers with no record
    (and, with ``configs``, named by a Hugging Face config the model was loaded with)."""
    out = [(name, a) for name, m in module.named_modules() for a in m.__dict__.get(MARK, ())]
    if configs:  # a config shared by nested modules (a PeftModel, its HF model, its backbone): the innermost
        owner = {
            id(getattr(m, "config", None)): (name, m.config)
            for name, m in module.named_modules()
            if hasattr(m, "config")
        }
        for name, config in owner.values():
            out += [(name, a) for a in (getattr(config, MARK, None) or []) if isinstance(a, str)]
    return out


_USED: list = []  # the statements runs were made on (kept alive, so that an id stays theirs)


def used(statement) -> bool:
    """Whether a run was made on this statement object: a copy of the model made before that run
    (``copy.copy`` shares it) must not make another run on it."""
    return any(s is statement for s in _USED)


def use(statement) -> None:
    if isinstance(statement, dict) and not used(statement):
        _USED.append(statement)


def disjoint_statement(module) -> bool:
    """``module.dpzoo_privacy = {}`` stated, and no run was made on it yet."""
    meta = module.__dict__.get("dpzoo_privacy")
    return meta == {} and not used(meta)


def _stated(module) -> bool:
    """The user stated the provenance of adapters in this module, for a run not made yet:
    ``dpzoo_adapter_privacy`` (a record or ``{}``), or a ``dpzoo_privacy`` record they set (one
    ``dpzoo.load`` attached does not count). A record that itself holds weights of unknown origin
    (``unknown_origin``) states only its own spending."""
    for key in ("dpzoo_adapter_privacy", "dpzoo_privacy"):
        meta = module.__dict__.get(key)
        if not isinstance(meta, Mapping) or used(meta) or (key == "dpzoo_privacy" and isinstance(meta, LoadedRecord)):
            continue
        if not meta.get("unknown_origin"):
            return True
    return False


STATED_DISJOINT = (
    "dpzoo_unknown_stated_disjoint"  # on a module: weights of unknown origin an earlier run took as disjoint
)


UNKNOWN_ORIGIN = (
    "weights of unknown origin, stated trained on data disjoint from an earlier run's (dpzoo_adapter_privacy = {}): "
    "their spending is not in this record, and a later run is refused until it is stated again"
)


def unknown_origin_note(module) -> str | None:
    """What a saved record says (its ``unknown_origin``) of weights in ``module`` still of unknown
    origin (:data:`STATED_DISJOINT`), so a reload is refused as the model in memory is."""
    return UNKNOWN_ORIGIN if any(m.__dict__.get(STATED_DISJOINT) for m in module.modules()) else None


def refuse_unnoted_unknown_origin(module, privacy: Mapping | None) -> None:
    """Refuse a record for ``module`` that does not say it holds weights of unknown origin."""
    if unknown_origin_note(module) and not (privacy or {}).get("unknown_origin"):
        raise PrivacyUsageError(
            "This model holds weights of unknown origin stated disjoint for an earlier run, and its record does not say "
            "so (unknown_origin), so a reload would not refuse a run on their data: save while the engine that trained "
            "it is attached (dpzoo.save takes its record), or add privacy['unknown_origin']."
        )


def _mark_with_wrapped(module, *more) -> None:
    """:data:`STATED_DISJOINT` on ``module``, on the model PEFT wraps in it (``merge_and_unload()``
    returns that one) and on ``more``."""
    from .peft_layers import wrapped_model

    for m in {id(x): x for x in (module, wrapped_model(module)[1], *more)}.values():
        object.__setattr__(m, STATED_DISJOINT, True)


def mark_weights_unknown(module) -> None:
    """Mark ``module``'s trained weights as holding weights of unknown origin (a checkpoint of a
    run on such weights, loaded into a fresh model): the model, the model PEFT wraps, and every
    module with trainable parameters."""
    _mark_with_wrapped(
        module, *(m for m in module.modules() if any(p.requires_grad for p in m.parameters(recurse=False)))
    )


def mark_unknown_origin(module, records) -> None:
    """Mark ``module`` (:data:`STATED_DISJOINT`) if a record it was loaded with has an ``unknown_origin``."""
    if any(isinstance(r, Mapping) and r.get("unknown_origin") for r in records):
        object.__setattr__(module, STATED_DISJOINT, True)


def stated_disjoint_before(module) -> list[tuple[str, str, str]]:
    """(module, "", what) for weights of unknown origin an earlier run here was told were trained on
    disjoint data: they are still of unknown origin for this run."""
    return [(name, "", "weights stated disjoint for an earlier run") for name, m in module.named_modules()
            if m.__dict__.get(STATED_DISJOINT)]  # fmt: skip


def refuse_unknown_origin(module, unknown: list[tuple[str, str, str]]) -> None:
    """Refuse ``unknown`` ((layer, adapter, what)) not covered by a statement on ``module`` or on a
    module holding the layer; every one is named, so one statement is made for all of them."""
    covered = {name for name, m in module.named_modules() if _stated(m)}
    left = [u for u in unknown if not any(c == "" or u[0] == c or u[0].startswith(c + ".") for c in covered)]
    if not left:
        return
    grouped: dict[tuple[str, str], list[str]] = {}
    for layer, adapter, what in left:
        grouped.setdefault((what, adapter), []).append(layer or "the model")
    names = "; ".join(
        f"{what}{f' {adapter!r}' if adapter else ''} in {layers[0]}"
        + (f" and {len(layers) - 1} more layers" if len(layers) > 1 else "")
        for (what, adapter), layers in grouped.items()
    )
    raise PrivacyUsageError(
        f"Trained LoRA weights of unknown origin ({names}) and no privacy record for them: if they come "
        "from a DP run, compose its budget with model.dpzoo_adapter_privacy = "
        "dpzoo.integrations.transformers.read_privacy_metadata(ADAPTER_DIR); if they were trained on other data "
        "than this run's, set model.dpzoo_adapter_privacy = {} (recorded in the metadata as a stated assumption). A "
        "record whose unknown_origin says it holds such weights states only its own spending: compose it with "
        "model.dpzoo_privacy = record and state the rest with model.dpzoo_adapter_privacy = {}."
    )


def unknown_weights(module, stated_disjoint: bool = True) -> list[tuple[str, str, str]]:
    """(layer, adapter, what) for every weight of unknown origin in ``module``: adapters trained
    elsewhere, adapters merged without a record, and (``stated_disjoint``) weights an earlier run
    was told were trained on disjoint data."""
    from .peft_adapters import trained_adapters

    unknown = [(layer, a, "adapter") for layer, a in trained_adapters(module)]
    unknown += [(layer, a, "merged adapter") for layer, a in merged_without_record(module)]
    unknown += [(name, "", "weights PEFT loaded without a record") for name, m in module.named_modules()
                if m.__dict__.get("dpzoo_loaded_without_record")]  # fmt: skip
    return unknown + (stated_disjoint_before(module) if stated_disjoint else [])


def clear_marks(module, unknown: list | None = None, disjoint: bool = False) -> None:
    """Forget the merge marks of ``module`` and the statements about them once a run composed them.
    Weights stated trained on disjoint data (``dpzoo_adapter_privacy = {}``, or, with ``unknown``
    weights present, ``dpzoo_privacy = {}``) stay of unknown origin (:data:`STATED_DISJOINT`):
    a later run, which may use that data, is refused until the user states again. ``disjoint``:
    the model's own ``dpzoo_privacy = {}``, which the run cleared. ``unknown``: the weights of
    unknown origin the run found (:func:`unknown_weights`); their layers are marked too (a shallow
    copy of the model shares them)."""
    stated_disjoint = False
    for m in module.modules():
        m.__dict__.pop(MARK, None)
        statement = m.__dict__.pop("dpzoo_adapter_privacy", None)  # composed into this run's history, not twice
        if statement == {}:  # (a record may be stated again: its runs compose once)
            use(statement)
        plain = disjoint if m is module else disjoint_statement(m)
        if unknown and plain:  # {} covered weights of unknown origin, for this run only
            use(m.__dict__.pop("dpzoo_privacy", None))
            statement = {} if statement is None else statement
        if isinstance(statement, Mapping) and statement.get("unknown_origin"):
            statement = {}  # a record that holds weights of unknown origin: they stay unknown
        if statement == {}:
            _mark_with_wrapped(m)
            stated_disjoint = True
        elif statement:
            m.__dict__.pop(STATED_DISJOINT, None)  # a record composed: known from now on
        config = getattr(m, "config", None)
        if config is not None and getattr(config, MARK, None) is not None:
            delattr(config, MARK)
    for layer, _, _ in unknown or [] if stated_disjoint else []:
        object.__setattr__(module.get_submodule(layer) if layer else module, STATED_DISJOINT, True)


def refuse_save_of_stated_merges(module) -> None:
    """``dpzoo.save`` writes one record; a stated record for merged adapters is composed by a DP run
    (``make_private``), so a model still holding such marks and statements is refused."""
    stated = [name for name, m in module.named_modules() if m.__dict__.get("dpzoo_adapter_privacy")]
    if stated and merged_without_record(module):
        raise PrivacyUsageError(
            f"{stated[0] or 'The model'} states the record of merged LoRA adapters (dpzoo_adapter_privacy), which a DP "
            "run composes, not dpzoo.save: train it with make_private first, or save with privacy= the record you composed."
        )
