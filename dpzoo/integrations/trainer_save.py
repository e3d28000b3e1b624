"""Privacy metadata beside a Hugging Face model directory: written by ``DPTrainer.save_model`` (and
every checkpoint), read back by :func:`dpzoo.hub.saved_files.read_privacy_metadata`.

Any model: ``save_pretrained``'s files plus ``dpzoo_privacy.json`` (:data:`PRIVACY_FILE`), the
fields of :data:`dpzoo.hub.load_save.PRIVACY_FIELDS` (ε, δ, accountant, steps, sample rate, σ, R, how noise
and sampling were drawn, the self-check's outcome); an infinite ε (σ = 0) is the string ``"inf"``,
as in ``dpzoo_config.json``. A model built by :func:`dpzoo.load` is also written with
:func:`dpzoo.save`'s semantics: its ``model.safetensors`` (privacy in the header too, and still
readable by ``from_pretrained``) and ``dpzoo_config.json``, so ``dpzoo.load(dir)`` restores it with
its privacy spending and ``dpzoo.privacy_metadata(dir)`` reads it (the final ``save_model`` only:
Trainer checkpoints keep ``save_pretrained``'s files, which the Trainer's resume reads).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

from torch import nn

from ..hub.load_save import save
from ..hub.privacy_card import CARD_NAME, read_card, render_card
from ..hub.saved_files import CONFIG_NAME, PRIVACY_FILE, WEIGHTS_NAME, checked_fields, read_privacy_metadata

__all__ = ["PRIVACY_FILE", "write_privacy_files", "read_privacy_metadata", "is_zoo_model"]


def is_zoo_model(model: nn.Module) -> bool:
    """Built by :func:`dpzoo.load` (and not wrapped, e.g. by PEFT, whose files are adapters)."""
    if callable(getattr(model, "get_base_model", None)):
        return False
    config = vars(model).get("dpzoo_config")
    return isinstance(config, dict) and "model_name" in config


def write_privacy_files(
    model: nn.Module, directory: str | os.PathLike, privacy: Mapping[str, Any] | None, *, zoo_files: bool = True
) -> None:
    """Add the privacy record to ``directory`` (already holding ``save_pretrained``'s files); a stale
    ``dpzoo_privacy.json`` is removed when there is none (a claim must not outlive its model).
    ``zoo_files``: for a dpzoo model, also write :func:`dpzoo.save`'s files (the final model;
    Trainer checkpoints keep ``save_pretrained``'s weights, which the Trainer's resume reads)."""
    directory = Path(directory)
    target = directory / PRIVACY_FILE
    if zoo_files and is_zoo_model(model):
        _save_zoo_files(model, directory, privacy)
    card = directory / CARD_NAME
    if privacy is None:
        target.unlink(missing_ok=True)
        if (read_card(directory) or {}).get("library_name") == "dpzoo":
            card.unlink()  # our card of an earlier save: its claim must not outlive its model
        return
    text = json.dumps(checked_fields(privacy), indent=2, sort_keys=True, allow_nan=False) + "\n"
    tmp = target.with_name(f".{PRIVACY_FILE}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, target)
    name = (vars(model).get("dpzoo_config") or {}).get("model_name") or type(model).__name__
    tmp = card.with_name(f".{CARD_NAME}.tmp-{os.getpid()}")
    tmp.write_text(render_card(name, dict(privacy)), encoding="utf-8")
    os.replace(tmp, card)


def _save_zoo_files(model: nn.Module, directory: Path, privacy: Mapping[str, Any] | None) -> None:
    """dpzoo.save into a scratch directory, then its weights and config moved beside the others."""
    scratch = Path(tempfile.mkdtemp(prefix=".dpzoo-save-", dir=directory))
    try:
        save(model, scratch / "model", privacy=privacy)
        for name in (WEIGHTS_NAME, CONFIG_NAME):
            os.replace(scratch / "model" / name, directory / name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def recorded_origin(module: nn.Module) -> tuple[dict, str] | None:
    """(privacy record, where) of a model reloaded outside dpzoo: the record a Hugging Face config
    carries (``config.dpzoo_privacy``, written by :func:`dpzoo.privacy.carried.link_spending` before ``save_pretrained``),
    else the dpzoo record in the directory ``from_pretrained`` read (``config._name_or_path``; a
    PEFT model's base too). None for a model with neither."""
    carried = None
    for m in module.modules():
        config = getattr(m, "config", None)
        path = getattr(config, "_name_or_path", None)
        if isinstance(path, str) and path and os.path.isdir(path):
            meta = read_privacy_metadata(path)
            if meta:  # a full record first: it has ε, δ and the rest, not only the history
                return meta, path
        record = getattr(config, "dpzoo_privacy", None)
        if carried is None and isinstance(record, dict) and record:
            carried = (record, "the model's config")
    return carried
