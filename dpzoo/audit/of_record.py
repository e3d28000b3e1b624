"""The empirical audit of a saved model's mechanism, recorded in its privacy card.

An audit cannot be run on the model's own data without spending privacy, so what links an audit to
a model is its mechanism: :func:`audit_record` runs the white-box one-run audit on the built-in
canary task with the model's σ, clipping norm R, clipping style and steps, at its sampling rate q
(the nearest the canary set allows), and the audit's claim is the ε of those settings. It tests
dpzoo's implementation of what trained the model (the per-sample clipping, the noise, the
accounting), not the model's data; the card says so. ``dpzoo audit --run RUN_DIR`` runs it and
:func:`record_audit` writes ``dpzoo_audit.json`` and the card's ``audit:`` block (with the
statement's sentence), which :func:`dpzoo.privacy_card.check_card` checks on every load.

With ``control=True`` the same audit also runs with every clip factor doubled (a 2R-sensitivity
bug): the card then says whether the audit, at these settings, would have caught that bug.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Mapping

from .. import __version__
from ..errors import DPZooError, PrivacyUsageError
from .report import AuditResult

__all__ = [
    "AUDIT_FILE",
    "audit_record",
    "record_audit",
    "audit_block",
    "audit_sentence",
    "check_audit",
    "replacing_audit",
]

AUDIT_FILE = "dpzoo_audit.json"
METHOD = "one-run canary audit (Steinke, Nasr & Jagielski 2023), white-box"
TESTS = "dpzoo's implementation of this model's mechanism, on a canary task; not this model's data"
MATCHED = ("noise_multiplier", "max_grad_norm", "clipping", "steps")  # the audit's mechanism is the record's
_REPLACING = contextvars.ContextVar("dpzoo_replacing_audit", default=False)


@contextlib.contextmanager
def replacing_audit():
    """Read a model's record while its card's audit block is about to be replaced (a stale or
    edited one is what a new audit overwrites; everything else on the card is still checked)."""
    token = _REPLACING.set(True)
    try:
        yield
    finally:
        _REPLACING.reset(token)


def _mechanism_of(record: Mapping[str, Any]) -> dict[str, Any]:
    """σ, q, steps, R, clipping, accountant and δ of a privacy record; refused where one audit on
    the canary task cannot reproduce the mechanism."""
    if not math.isfinite(record.get("epsilon", math.inf)) or not record.get("noise_multiplier"):
        raise PrivacyUsageError("This model was trained without noise (ε = ∞): there is no guarantee to audit.")
    history = record.get("history") or [[record["noise_multiplier"], record["sample_rate"], record["steps"]]]
    if any(len(h) > 3 for h in history):
        raise PrivacyUsageError(
            "This model was trained with example-level sampling of users (user_sampling='examples'): its mixture "
            "mechanism has no canary audit from a record; the user-level audit is in tests/test_audit_paths.py."
        )
    if len({(float(s), float(q)) for s, q, _ in history}) > 1:
        raise PrivacyUsageError(
            f"This model's record composes {len(history)} releases with different σ or q: one audit covers one "
            "mechanism; run dpzoo.audit.audit(noise_multiplier=..., sample_rate=..., steps=...) for each."
        )
    sigma, q, _ = history[0]
    return {
        "noise_multiplier": float(sigma),
        "sample_rate": float(q),
        "steps": int(sum(int(h[2]) for h in history)),
        "max_grad_norm": float(record["max_grad_norm"]),
        "clipping": record.get("clipping", "abadi"),
        "accountant": record["accountant"],
        # the canary set is small: a run's δ can be ≥ 1/N there, and a smaller δ tests the same mechanism
        "delta": min(float(record["delta"]), 1e-5),
    }


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

    mech = _mechanism_of(record)
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


def audit_block(saved: Mapping[str, Any]) -> dict[str, Any]:
    """The card's ``audit:`` block from ``dpzoo_audit.json``'s content (:func:`record_audit`)."""
    result, control = saved["result"], saved.get("control")
    mech = result["mechanism"]
    block: dict[str, Any] = {
        "method": METHOD,
        "threat_model": mech.get("threat_model"),
        "tests": TESTS,
        "mechanism": {k: mech[k] for k in ("noise_multiplier", "max_grad_norm", "clipping", "sample_rate", "steps")},
        "accountant": mech.get("accountant"),
        "claimed_epsilon": result["claimed_epsilon"],
        "delta": result["delta"],
        "epsilon_lower_bound": result["epsilon_lower_bound"],
        "confidence": result["confidence"],
        "canaries": result["canaries"],
        "max_auditable_epsilon": result["max_auditable_epsilon"],
        "exceeds": result["exceeds"],
        "dpzoo_version": saved["dpzoo_version"],
    }
    if control is not None:
        block["control_sensitivity_2x"] = {
            "epsilon_lower_bound": control["epsilon_lower_bound"],
            "caught": control["exceeds"],
        }
    return block


def audit_sentence(block: Mapping[str, Any], run_sample_rate: float) -> str:
    """The statement's sentence for an audit block."""
    m = block["mechanism"]
    found = (
        f"found ε ≥ {block['epsilon_lower_bound']:.3g} at {block['confidence']:.0%} confidence, "
        + (
            f"ABOVE the ε = {block['claimed_epsilon']:.3g} claimed for those settings at δ = {block['delta']:.3g}: the "
            "implementation leaked more "
            "than it claims"
            if block["exceeds"]
            else f"below the ε = {block['claimed_epsilon']:.3g} claimed for those settings at δ = {block['delta']:.3g}"
        )
        + f" (the most it could show: {block['max_auditable_epsilon']:.3g})"
    )
    control = block.get("control_sensitivity_2x")
    power = ""
    if control is not None:
        power = f"; with every clip doubled the same audit found ε ≥ {control['epsilon_lower_bound']:.3g}, " + (
            "so it would catch such a bug"
            if control["caught"]
            else "so it could NOT catch such a bug at these settings"
        )
    return (
        f"Audited: a white-box one-run audit (Steinke et al. 2023) of dpzoo's implementation of this mechanism "
        f"(σ = {m['noise_multiplier']:.4g}, R = {m['max_grad_norm']:g}, {m['clipping']} clipping, {m['steps']} steps; "
        f"q = {m['sample_rate']:.4g} on the canary set against the run's {run_sample_rate:.4g}) with "
        f"{block['canaries']} canaries {found}{power}. It tests the implementation, not this model's data."
    )


def check_audit(directory: Path, card_audit: Any, record: Mapping[str, Any]) -> bool:
    """Refuse a card's audit block that ``dpzoo_audit.json`` does not give, or that audited another
    mechanism than the record's (σ, R, clipping, steps). False (nothing checked) while the block is
    being replaced (:func:`replacing_audit`)."""
    from ..errors import CheckpointError
    from ..privacy_card import CARD_NAME, same_value

    if _REPLACING.get():
        return False
    path = directory / CARD_NAME
    file = directory / AUDIT_FILE
    try:
        saved = json.loads(file.read_text())
        expected = audit_block(saved)
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(
            f"{path} states an audit that {file.name} does not hold: rerun `dpzoo audit --run`."
        ) from None
    if not same_value(card_audit, expected):
        raise CheckpointError(f"{path}: its audit block is not {file.name}'s (edited?); rerun `dpzoo audit --run`.")
    mine = _mechanism_of(record)
    for key in MATCHED:
        if not same_value(expected["mechanism"][key], mine[key]):
            raise CheckpointError(
                f"{path}: its audit ran {key} = {expected['mechanism'][key]!r}, the model's record says {mine[key]!r}: "
                "the audit is of another mechanism; rerun `dpzoo audit --run`."
            )
    return True


def record_audit(directory: str | os.PathLike, result: AuditResult, control: AuditResult | None = None) -> dict:
    """Write ``result`` (and the 2R ``control``) into the model directory ``directory``:
    ``dpzoo_audit.json``, then the card with its ``audit:`` block. Refused if the result is not
    the audit of the directory's record. Returns the block."""
    from ..integrations.trainer_save import read_privacy_metadata
    from ..privacy_card import read_card, render_card, same_value

    directory = Path(directory)
    with replacing_audit():
        record = read_privacy_metadata(directory)
    front = read_card(directory)
    if record is None or front is None:
        raise DPZooError(f"{directory} holds no private model with a card: save it with dpzoo.save first.")
    if result.broken is not None or (control is not None and control.broken != "sensitivity-2x"):
        raise DPZooError("record_audit takes the audit of dpzoo's engine and, as control, its sensitivity-2x run.")
    saved = {
        "dpzoo_version": __version__,
        "result": result.to_dict(scores=False),
        "control": control.to_dict(scores=False) if control is not None else None,
    }
    block = audit_block(saved)
    mine = _mechanism_of(record)
    if not all(same_value(block["mechanism"][k], mine[k]) for k in MATCHED):
        raise DPZooError(f"This audit ran another mechanism than {directory}'s record: audit it with audit_record.")
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
