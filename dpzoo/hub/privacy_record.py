"""What a saved model's privacy metadata may hold (:data:`PRIVACY_FIELDS`), how a record is
checked before it is written (:func:`check_privacy`), how an infinite ε crosses JSON, and how a
record is read back from a checkpoint's safetensors header (:func:`privacy_from_header`), and what
marks a record ``dpzoo.load`` attached (:class:`LoadedRecord`)."""

from __future__ import annotations

import ast
import math
from typing import Any, Mapping

from ..errors import CheckpointError, SaveError

__all__ = [
    "PRIVACY_FIELDS",
    "check_privacy",
    "privacy_to_json",
    "privacy_from_json",
    "privacy_from_header",
    "spending_of",
    "LoadedRecord",
    "refuse_file_beside_hf_record",
]


class LoadedRecord(dict):
    """A privacy record ``dpzoo.load`` attached to a model (``model.dpzoo_privacy``): the spending of
    the saved weights, not the user's statement about adapters merged into them later."""


HEADER_PREFIX = "dpzoo.privacy."

# Privacy metadata a DP-trained model carries (the engine fills it; users may too).
PRIVACY_FIELDS = {
    "epsilon": float,
    "delta": float,
    "accountant": str,
    "steps": int,
    "sample_rate": float,
    "noise_multiplier": float,
    "max_grad_norm": float,
    "privacy_unit": str,  # "sample" (one example), "user" (all of one user's examples), "sequence"
    "users": int,  # privacy_unit "user": how many users the data has (N for δ < 1/N)
    "max_examples_per_user": int,  # privacy_unit "user": k, the most examples of a user in one step
    "clipping": str,  # "abadi" (min(1, R/‖g‖)) or "automatic" (R/(‖g‖ + γ))
    "noise": str,
    "sampling": str,
    "self_check": str,
    "history": list,  # the accountant's [σ, q, steps] entries, all composed into ε
    "run_id": str,  # the run's identity: a later run that finds this record and the run's own link counts it once
    "composed_runs": list,  # [[run id or None, steps], ...]: the runs this history composed before its own steps
    "disjoint_spending": dict,  # what the model spent before a run on data stated disjoint (outside ε, composed later)
    "unknown_origin": str,  # weights in the model this record does not account for (a later run is refused until stated)
    "public_statistics": str,  # what the run used from its data outside ε (the user's stated assumption)
    "delta_note": str,  # δ ≥ 1/N accepted by the user (make_private(accept_large_delta=True))
}
_REQUIRED_PRIVACY = ("epsilon", "delta", "accountant", "steps", "sample_rate")
# JSON has no infinity: an infinite ε (σ = 0, no guarantee) is written as this string and read
# back as float("inf") by read_config / privacy_metadata. The safetensors header stores str(ε),
# which is "inf" too.
_INFINITE = "inf"


def check_privacy(privacy: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if privacy is None:
        return None
    if not isinstance(privacy, Mapping):
        raise SaveError(f"privacy must be a dict, got {type(privacy).__name__}")
    unknown = [k for k in privacy if k not in PRIVACY_FIELDS]
    if unknown:
        raise SaveError(f"Unknown privacy field(s) {unknown}; allowed: {sorted(PRIVACY_FIELDS)}.")
    missing = [k for k in _REQUIRED_PRIVACY if k not in privacy]
    if missing:
        raise SaveError(f"privacy metadata lacks {missing}; a DP claim needs {', '.join(_REQUIRED_PRIVACY)}.")
    out = {}
    for key, value in privacy.items():
        kind = PRIVACY_FIELDS[key]
        if key == "epsilon" and value == _INFINITE:
            value = math.inf
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            value = float(value)
            if key == "epsilon" and value == math.inf:
                pass  # σ = 0: no guarantee, recorded as such (never as a large finite number)
            elif not math.isfinite(value) or value < 0:
                raise SaveError(
                    f"privacy {key} must be finite and >= 0, got {value}"
                    + ("; ε may also be float('inf') (no guarantee)." if key == "epsilon" else ".")
                )
        elif not isinstance(value, kind) or isinstance(value, bool):
            raise SaveError(f"privacy {key} must be {kind.__name__}, got {value!r}")
        if key == "history":
            value = _check_history(value)
        if key == "composed_runs":
            value = _check_composed(value)
        if key == "disjoint_spending":
            value = {**value, "history": _check_history(value.get("history") or []),
                     "composed_runs": _check_composed(value.get("composed_runs") or [])}  # fmt: skip
        out[key] = value
    if not 0 < out["delta"] < 1 or not 0 < out["sample_rate"] <= 1 or out["steps"] < 0:
        raise SaveError(
            "privacy needs 0 < delta < 1, 0 < sample_rate <= 1 and steps >= 0, "
            f"got delta={out['delta']}, sample_rate={out['sample_rate']}, steps={out['steps']}"
        )
    return out


def _check_history(history: list) -> list:
    rows = []
    for row in history:
        ok = isinstance(row, (list, tuple)) and len(row) in (3, 4)  # [σ, q, steps, k]: k examples per user
        if ok:
            sigma, q, *counts = row
            ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (sigma, q)) and all(
                isinstance(c, int) and not isinstance(c, bool) for c in counts
            )
            ok = ok and sigma >= 0 and 0 < q <= 1 and counts[0] >= 0 and (len(counts) == 1 or counts[1] >= 2)
        if not ok:
            raise SaveError(
                f"privacy history rows must be [σ >= 0, 0 < q <= 1, steps >= 0] or [σ, q, steps, k >= 2], got {row!r}."
            )
        rows.append([float(row[0]), float(row[1]), *(int(c) for c in row[2:])])
    return rows


def _check_composed(composed: list) -> list:
    rows = [list(row) for row in composed if isinstance(row, (list, tuple)) and len(row) == 2]
    ok = len(rows) == len(composed) and all(
        (key is None or isinstance(key, str)) and isinstance(n, int) and not isinstance(n, bool) and n >= 0
        for key, n in rows
    )
    if not ok:
        raise SaveError(f"privacy composed_runs rows must be [run id or None, steps >= 0], got {composed!r}.")
    return rows


def privacy_to_json(privacy: dict[str, Any] | None) -> dict[str, Any] | None:
    if privacy is None or privacy["epsilon"] != math.inf:
        return privacy
    return {**privacy, "epsilon": _INFINITE}


def privacy_from_json(privacy: Any) -> Any:
    if isinstance(privacy, dict) and privacy.get("epsilon") == _INFINITE:
        return {**privacy, "epsilon": math.inf}
    return privacy


def privacy_from_header(metadata: Mapping[str, str] | None, source: str) -> dict[str, Any] | None:
    """The privacy record :func:`dpzoo.save` wrote into a safetensors header (``dpzoo.privacy.*``,
    each value as ``str(value)``), or None when there is none. A record that cannot be read back is
    refused (:class:`~dpzoo.errors.CheckpointError`), never dropped: a later run must compose it."""
    found = {k[len(HEADER_PREFIX) :]: v for k, v in (metadata or {}).items() if k.startswith(HEADER_PREFIX)}
    if not found:
        return None
    record: dict[str, Any] = {}
    for key, text in found.items():
        if PRIVACY_FIELDS.get(key) is str:
            record[key] = text
        elif text == _INFINITE:
            record[key] = math.inf
        else:
            try:
                record[key] = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                record[key] = text  # check_privacy says what is wrong with it
    try:
        return check_privacy(record)
    except SaveError as e:
        raise CheckpointError(
            f"{source} carries a dpzoo privacy record that cannot be read back ({e}); a model trained from it "
            "would not compose that spending into its ε. Load it with dpzoo.load(<its saved directory>) instead."
        ) from None


def spending_of(privacy: Mapping[str, Any]) -> dict[str, Any]:
    """What a Hugging Face ``config.json`` carries of a record (``dpzoo_privacy``): the accountant and
    the whole (σ, q, steps) history that later runs compose; the record itself (JSON-safe) when it has
    no σ to compose with, which a later run then refuses to ignore."""
    history = privacy.get("history")
    if not history and privacy.get("noise_multiplier") is not None and privacy.get("steps"):
        history = [[privacy["noise_multiplier"], privacy["sample_rate"], privacy["steps"]]]
    if history:
        identity = {k: privacy[k] for k in ("run_id", "composed_runs", "disjoint_spending") if k in privacy}
        return {"accountant": privacy["accountant"], "history": [list(h) for h in history], **identity}
    return privacy_to_json(dict(privacy)) or {}


def refuse_file_beside_hf_record(path) -> None:
    """A weights file from a Hugging Face directory whose ``config.json`` carries dpzoo's spending or
    merge marks (``dpzoo_privacy``, ``dpzoo_merged_adapters``): loaded on its own, that record would
    be lost, so the directory must be given."""
    import json
    from pathlib import Path

    config = Path(path).parent / "config.json"
    if Path(path).is_dir() or not config.is_file():
        return
    try:
        carried = json.loads(config.read_text())
    except (OSError, ValueError):
        return  # not a config dpzoo wrote into: the architecture's own loading reads it
    if isinstance(carried, dict) and ({"dpzoo_privacy", "dpzoo_merged_adapters"} & carried.keys()):
        raise CheckpointError(
            f"{config} carries a dpzoo privacy record that loading {Path(path).name} alone would drop: pass the "
            f"directory, weights={str(Path(path).parent)!r}."
        )
