"""The empirical audit of a saved model's mechanism, recorded in its privacy card.

An audit cannot be run on the model's own data without spending privacy, so what links an audit to
a model is its mechanism: :func:`audit_record` runs the white-box one-run audit on the built-in
canary task with the model's σ, clipping norm R, clipping style and steps, at its sampling rate q
(the nearest the canary set allows), and the audit's claim is the ε of those settings. It tests
dpzoo's implementation of what trained the model (the per-sample clipping, the noise, the
accounting), not the model's data; the card says so. ``dpzoo audit --run RUN_DIR`` runs it and
:func:`record_audit` writes ``dpzoo_audit.json`` (with every canary's score, the evidence) and the
card's ``audit:`` block with the statement's sentence, both rebuilt from that evidence and checked
on every load (:mod:`dpzoo.audit.recorded`).

With ``control=True`` the same audit also runs with every clip doubled (a 2R-sensitivity bug): the
card then says whether the audit, at these settings, would have caught that bug.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping

from ..errors import DPZooError
from ..versions import __version__
from .recorded import AUDIT_FILE, mechanism_of, replacing_audit, verified_block
from .report import AuditResult

__all__ = ["audit_record", "record_audit"]


def audit_record(
    record: Mapping[str, Any],
    *,
    canaries: int | None = None,
    seed: int = 0,
    confidence: float = 0.95,
    broken: str | None = None,
    log: Callable[[str], None] | None = None,
    progress: bool | None = None,
) -> AuditResult:
    """The white-box audit of ``record``'s mechanism (a privacy record: ``dpzoo.privacy_metadata``)
    on the canary task; ``broken="sensitivity-2x"`` runs the positive control at the same settings."""
    from .run import audit

    mech = mechanism_of(record)
    return audit(
        delta=mech["delta"],
        canaries=canaries,
        max_grad_norm=mech["max_grad_norm"],
        clipping=mech["clipping"],
        broken=broken,
        confidence=confidence,
        seed=seed,
        accountant=mech["accountant"],
        log=log,
        progress=progress,
        threat_model="white-box",
        noise_multiplier=mech["noise_multiplier"],
        sample_rate=mech["sample_rate"],
        steps=mech["steps"],
    )


def record_audit(
    directory: str | os.PathLike, result: AuditResult, control: AuditResult | None = None, seed: int = 0
) -> dict:
    """Write ``result`` (and the 2R ``control``; ``seed``: the audits' seed, for their tie-breaking)
    into the model directory ``directory``: ``dpzoo_audit.json``, then the card with its ``audit:``
    block. Refused if they are not the white-box audit of the directory's record and its control.
    Returns the block."""
    from ..hub.privacy_card import read_card, render_card
    from ..hub.saved_files import read_privacy_metadata

    directory = Path(directory)
    with replacing_audit():
        record = read_privacy_metadata(directory)
    front = read_card(directory)
    if record is None or front is None:
        raise DPZooError(f"{directory} holds no private model with a card: save it with dpzoo.save first.")
    if result.broken is not None or (control is not None and control.broken != "sensitivity-2x"):
        raise DPZooError("record_audit takes the audit of dpzoo's engine and, as control, its sensitivity-2x run.")
    saved: dict[str, Any] = {
        "dpzoo_version": __version__,
        "seed": int(seed),
        "run": mechanism_of(record),
        "result": result.to_dict(),
        "control": control.to_dict() if control is not None else None,
    }
    try:
        block = verified_block(saved, record)
    except DPZooError as e:
        raise DPZooError(
            f"This is not the white-box audit of {directory}'s mechanism ({e}): audit it with audit_record."
        ) from None
    card = render_card(
        front.get("dpzoo_model", directory.name),
        record,
        audit=block,
        base_model=front.get("base_model"),
        datasets=front.get("datasets"),
    )
    for name, text in (
        (AUDIT_FILE, json.dumps(saved, indent=1)),
        ("README.md", card),
    ):  # the card last: it points at the file
        tmp = directory / f".{name}.tmp"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, directory / name)
    return block
