"""The privacy guarantee of a model or a saved directory in plain words (``dpzoo.privacy_statement``):
the record found on the model (its engine's, or the one it was loaded with) or in the directory,
rendered by :func:`~dpzoo.hub.privacy_card.statement_from_record`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from ..privacy.engine import engine_of
from .load_save import run_model_directory
from .privacy_card import read_card, statement_from_record
from .saved_files import read_privacy_metadata

__all__ = ["privacy_statement"]


def privacy_statement(model_or_dir: Any, fpr: float = 0.01) -> str:
    """The privacy guarantee of a model in plain words: ``model_or_dir`` is a model (trained by
    dpzoo's engine, or loaded with its record), a directory (``dpzoo.save``'s, a ``dpzoo train
    --out`` run, or a Hugging Face directory ``DPTrainer`` saved), or a privacy record itself."""
    audit = None
    if isinstance(model_or_dir, (str, Path)):
        audit = ((read_card(run_model_directory(model_or_dir)) or {}).get("privacy") or {}).get("audit")
    return statement_from_record(_record_of(model_or_dir), fpr, audit=audit)


def _record_of(obj: Any) -> Mapping[str, Any] | None:
    if obj is None or isinstance(obj, Mapping):
        return obj
    if isinstance(obj, (str, Path)):
        return read_privacy_metadata(run_model_directory(obj))
    engine = engine_of(obj)
    if engine is not None and engine.steps > 0:
        return engine.privacy_metadata()
    return getattr(obj, "dpzoo_privacy", None)
