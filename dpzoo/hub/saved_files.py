"""What a saved model's directory holds, read and checked without building a model.

``dpzoo_config.json`` (:func:`read_config`, :func:`privacy_metadata`: written by
:func:`dpzoo.save`) and ``dpzoo_privacy.json`` (:func:`read_privacy_metadata`: written beside
``save_pretrained``'s files by the Trainer integration and LoRA adapters' saves). Every record read
is validated as it was when written, and a card beside it must say the same
(:mod:`.privacy_card`). Low in the layers: the engine's record of carried spending
(:mod:`dpzoo.privacy.carried`) reads these files, and ``load`` / ``save`` build on them.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

from ..errors import SaveError
from .privacy_card import check_card, check_saved_card
from .privacy_record import PRIVACY_FIELDS, check_privacy, privacy_from_json

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "PRIVACY_FILE", "read_config", "privacy_metadata", "read_privacy_metadata"]
__all__ += ["checked_fields"]

CONFIG_NAME = "dpzoo_config.json"
WEIGHTS_NAME = "model.safetensors"
HF_CONFIG_NAME = "config.json"  # a transformers model's config, beside dpzoo's
FORMAT_VERSION = 1
PRIVACY_FILE = "dpzoo_privacy.json"
INFINITE = "inf"  # JSON has no infinity (dpzoo.save writes ε = inf the same way)


def read_config(directory: str | os.PathLike) -> dict[str, Any]:
    """The ``dpzoo_config.json`` of a saved model, checked."""
    directory = Path(directory)
    if not directory.is_dir():
        raise SaveError(f"{directory} is not a directory written by dpzoo.save.")
    cfg_path = directory / CONFIG_NAME
    if not cfg_path.exists():
        hint = (
            " It looks like a Hugging Face directory: pass it as weights=DIR to a transformers zoo entry."
            if (directory / HF_CONFIG_NAME).exists()
            else ""
        )
        raise SaveError(f"{directory} has no {CONFIG_NAME}, so dpzoo.save did not write it.{hint}")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SaveError(f"{cfg_path} is corrupt ({e}).") from None
    if not isinstance(cfg, dict) or "model_name" not in cfg:
        raise SaveError(f"{cfg_path} lacks model_name; it is not a dpzoo config.")
    if cfg.get("format_version", 0) > FORMAT_VERSION:
        raise SaveError(f"{directory} was written by a newer dpzoo (format {cfg['format_version']}); upgrade dpzoo.")
    if cfg.get("privacy") is not None:  # validated as save validates it: a hand-edited record is refused
        try:
            cfg["privacy"] = check_privacy(privacy_from_json(cfg["privacy"]))
        except SaveError as e:
            raise SaveError(
                f"{cfg_path}: its privacy record is invalid ({e}); it cannot be composed into a new ε."
            ) from None
    check_saved_card(directory, cfg.get("privacy"), directory / WEIGHTS_NAME)
    return cfg


def privacy_metadata(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The privacy metadata saved with a model, or None for a model saved without it.

    An ε recorded as infinite (noise multiplier 0: no guarantee) is returned as ``float("inf")``."""
    return read_config(directory).get("privacy")


def checked_fields(privacy: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a privacy record as ``dpzoo_privacy.json`` holds them (ε = inf written as "inf")."""
    unknown = sorted(k for k in privacy if k not in PRIVACY_FIELDS)
    if unknown:
        raise SaveError(f"Unknown privacy field(s) {unknown}; allowed: {sorted(PRIVACY_FIELDS)}.")
    missing = [k for k in ("epsilon", "delta", "accountant", "steps", "sample_rate") if k not in privacy]
    if missing:
        raise SaveError(f"privacy metadata lacks {missing}.")
    out = dict(privacy)
    if out["epsilon"] == math.inf:
        out["epsilon"] = INFINITE
    return out


def read_privacy_metadata(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The privacy metadata saved with a model directory (``dpzoo_privacy.json``, else a dpzoo.save
    directory's), or None when it has none. An infinite ε comes back as ``float("inf")``.

    ``model.dpzoo_privacy = read_privacy_metadata(dir)`` after ``from_pretrained(dir)`` makes a new
    private run on the same data compose after this spending (the engine reads it)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise SaveError(f"{directory} is not a directory.")
    path = directory / PRIVACY_FILE
    if path.exists():
        try:
            meta = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SaveError(f"{path} is corrupt ({e}).") from None
        if not isinstance(meta, dict):
            raise SaveError(f"{path} does not hold a JSON object of privacy fields.")
        if meta.get("epsilon") == INFINITE:
            meta["epsilon"] = math.inf
        record = _checked_file(meta, path)
        check_card(directory, record, record)  # a card beside it must say the same
        return record
    if (directory / CONFIG_NAME).exists():
        return privacy_metadata(directory)
    return None


def _checked_file(meta: dict, path: Path) -> dict[str, Any]:
    try:
        checked_fields(meta)
    except SaveError as e:
        raise SaveError(f"{path}: {e}") from None
    return meta
