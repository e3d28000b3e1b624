"""``save_pretrained`` writes what the model it is called on carries; ``from_pretrained`` keeps what it says.

A Hugging Face model's record (``config.dpzoo_privacy``, a
:class:`~dpzoo.privacy.carried.LiveRecord`) is written by the runs that train the model, or a
module around it, and is the record of those modules. A model can also be saved that no run
wrapped as a whole: a classifier whose head alone was trained (a probe on cached features), the
body of an LM whose outer model is gone, an EMA copy of the body only. So
``PreTrainedModel.save_pretrained`` is wrapped: when the model carries spending, it becomes one
of its record's models first (``LiveRecord.replacing``), so the record it writes holds its steps.
``from_pretrained`` is wrapped too: a record the model is reloaded with that says some of its
weights are of unknown origin (``unknown_origin``) marks the model, so a run on it is refused until
stated, as it was before the save. Installed by ``import dpzoo`` once ``transformers.modeling_utils`` is imported
(:func:`~dpzoo.integrations.after_import.when_imported`), so ``import dpzoo`` stays free of torch and transformers.
"""

from __future__ import annotations

import functools

from .after_import import when_imported

__all__ = ["install"]

_done: list[bool] = []


def install() -> None:
    """Wrap ``save_pretrained`` from now on (idempotent); defers until transformers' models load."""
    if not _done:
        when_imported("transformers.modeling_utils", _register)


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

    load = PreTrainedModel.__dict__["from_pretrained"].__func__

    @functools.wraps(load)
    def from_pretrained(cls, *args, **kwargs):
        out = load(cls, *args, **kwargs)
        _mark_unknown_origin(out[0] if isinstance(out, tuple) else out)
        return out

    PreTrainedModel.from_pretrained = classmethod(from_pretrained)  # type: ignore[method-assign, assignment]


def _mark_unknown_origin(model) -> None:
    """A record the model was reloaded with that says some of its weights are of unknown origin
    marks the model, so a run on it is refused until stated, as the model that was saved was."""
    from ..integrations.peft_statements import mark_unknown_origin
    from ..privacy.carried import recorded_origins

    mark_unknown_origin(model, recorded_origins(model))


def _own_record(model) -> None:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        return
    from ..privacy.carried import LiveRecord, carried_parts

    if carried_parts(model, statements=False):  # it spent something: its record holds it
        old = getattr(config, "dpzoo_privacy", None)
        name = old.name if isinstance(old, LiveRecord) else "rdp"  # the record's label; its history is what counts
        config.dpzoo_privacy = LiveRecord.replacing(config, model, name)
