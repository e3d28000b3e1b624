"""An audit recorded with a saved model, checked before anything states it.

``dpzoo_audit.json`` keeps the audit of the model's mechanism (:mod:`dpzoo.audit.of_record`) with
its raw evidence: every canary's score and membership, for the audit and its 2R control. The card's
``audit:`` block is never read back as such: :func:`verified_block` rebuilds it from that evidence.
It refuses an audit of another mechanism than the model's record (σ, R, clipping, steps,
accountant, the sampling rate the canary set allowed for the record's q, δ), a control that is not
the same audit with every clip doubled, or one that is not white-box; and it recomputes each claim
with the accountant and each bound, and so ``exceeds`` and ``caught``, from the scores. A hand
edit of the file's derived numbers is then either recomputed away or refused. The scores
themselves are the audit's own report: an edit of them that keeps the file consistent cannot be
told from a real audit (re-run ``dpzoo audit --run`` to check a card you did not write).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import re
from typing import Any, Mapping

from ..errors import CheckpointError, PrivacyUsageError

__all__ = [
    "AUDIT_FILE",
    "SENTENCE_START",
    "mechanism_of",
    "verified_block",
    "audit_sentence",
    "replacing_audit",
    "replacing",
    "stated_audits",
]

AUDIT_FILE = "dpzoo_audit.json"
METHOD = "one-run canary audit (Steinke, Nasr & Jagielski 2023), white-box"
TESTS = "dpzoo's implementation of this model's mechanism, on a canary task; not this model's data"
SENTENCE_START = "Audited: "
_NOT_THIS = AUDIT_FILE + " is not an audit of this model's mechanism ({why}): rerun `dpzoo audit --run`."
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


def replacing() -> bool:
    return _REPLACING.get()


def mechanism_of(record: Mapping[str, Any]) -> dict[str, Any]:
    """σ, q, steps, R, clipping, accountant and the audit's δ of a privacy record; refused where one
    example-level audit on the canary task does not reproduce the mechanism."""
    if not math.isfinite(record.get("epsilon", math.inf)) or not record.get("noise_multiplier"):
        raise PrivacyUsageError("This model was trained without noise (ε = ∞): there is no guarantee to audit.")
    history = record.get("history") or [[record["noise_multiplier"], record["sample_rate"], record["steps"]]]
    if any(len(h) > 3 for h in history) or int(record.get("max_examples_per_user", 1)) > 1:
        raise PrivacyUsageError(
            "This model was trained with user-level DP over several examples per user: the audit of a record runs "
            "example-level canaries, which do not exercise the per-user sum; the user-level audit is in "
            "tests/test_audit_paths.py."
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


def _recomputed(run: Mapping[str, Any], result: Mapping[str, Any], seed: int, clip_factor: float) -> dict:
    """The audit ``result`` (a saved AuditResult) checked against ``run`` (the record's mechanism)
    and recomputed from its scores: (claimed ε, bound, most it could show, canaries, confidence)."""
    import torch

    from ..privacy.accounting.accountant import Accountant
    from .from_scores import audit_from_scores

    m = result["mechanism"]
    same = [
        m.get("threat_model", "").startswith("white-box"),
        m.get("claimed_noise_multiplier") == run["noise_multiplier"],
        m.get("max_grad_norm") == run["max_grad_norm"],
        math.isclose(m.get("actual_max_grad_norm", math.nan), clip_factor * run["max_grad_norm"]),
        m.get("clipping") == run["clipping"],
        m.get("steps") == run["steps"],
        m.get("accountant") == run["accountant"],
        result.get("delta") == run["delta"],
        _canary_rate(m, run["sample_rate"]),
    ]
    if not all(same):
        raise CheckpointError(_NOT_THIS.format(why="its mechanism is not the record's"))
    claimed = Accountant(run["accountant"], [[run["noise_multiplier"], m["sample_rate"], run["steps"]]])
    again = audit_from_scores(
        torch.tensor(result["scores"], dtype=torch.float64),
        torch.tensor(result["membership"], dtype=torch.bool),
        claimed_epsilon=claimed.get_epsilon(run["delta"]),
        delta=run["delta"],
        confidence=float(result["confidence"]),
        white_box=True,
        seed=seed,
    )
    return {
        "claimed_epsilon": again.claimed_epsilon,
        "epsilon_lower_bound": again.epsilon_lower_bound,
        "max_auditable_epsilon": again.max_auditable_epsilon,
        "canaries": again.canaries,
        "confidence": again.confidence,
        "exceeds": again.exceeds,
        "sample_rate": m["sample_rate"],
    }


def _canary_rate(m: Mapping[str, Any], run_rate: float) -> bool:
    """The canary set's rate is the one audit() takes for the run's q: batch = max(1, round(q·N))."""
    batch, rate = m.get("batch_size"), m.get("sample_rate")
    if not isinstance(batch, int) or not rate:
        return False
    n = round(batch / rate)
    return math.isclose(rate, batch / n) and batch == max(1, round(run_rate * n))


def _same_audit(main: Mapping[str, Any], control: Mapping[str, Any]) -> bool:
    """The control ran the main audit's canaries, confidence, batches, epochs, learning rate and mode."""
    a, b = main["mechanism"], control["mechanism"]
    return (
        len(main["scores"]) == len(control["scores"])
        and main["confidence"] == control["confidence"]
        and all(a.get(k) == b.get(k) for k in ("batch_size", "epochs", "lr", "mode", "sample_rate", "steps"))
    )


def stated_audits(text: str) -> int:
    """How many audit sentences ``text`` holds, whatever their case, spacing, invisible characters
    or colon (NFKC-normalised; a homoglyph of another script is not seen)."""
    import unicodedata

    plain = "".join(ch for ch in unicodedata.normalize("NFKC", text) if unicodedata.category(ch) != "Cf")
    return len(re.findall(r"audited\s*[:\-\u2013\u2014]", plain, flags=re.IGNORECASE))


def verified_block(saved: Mapping[str, Any], record: Mapping[str, Any]) -> dict[str, Any]:
    """The card's ``audit:`` block for ``dpzoo_audit.json``'s content ``saved``, checked against the
    model's ``record`` and recomputed from its evidence (see the module docstring)."""
    run = mechanism_of(record)
    try:
        seed = int(saved["seed"])
        if saved["run"] != run:
            raise CheckpointError(_NOT_THIS.format(why="it was run for another record"))
        main = _recomputed(run, saved["result"], seed, 1.0)
        control = saved.get("control")
        checked = _recomputed(run, control, seed, 2.0) if control is not None else None
        if control is not None and not _same_audit(saved["result"], control):
            raise CheckpointError(_NOT_THIS.format(why="its control is not the same audit with the clip doubled"))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(
            f"{AUDIT_FILE} is not an audit of this model's mechanism ({e}): rerun `dpzoo audit --run`."
        ) from None
    block: dict[str, Any] = {
        "method": METHOD,
        "threat_model": "white-box: every noisy step",
        "tests": TESTS,
        "mechanism": {
            "noise_multiplier": run["noise_multiplier"],
            "max_grad_norm": run["max_grad_norm"],
            "clipping": run["clipping"],
            "sample_rate": main.pop("sample_rate"),
            "steps": run["steps"],
        },
        "accountant": run["accountant"],
        "delta": run["delta"],
        **main,
        "dpzoo_version": saved.get("dpzoo_version"),
    }
    if checked is not None:
        block["control_sensitivity_2x"] = {
            "epsilon_lower_bound": checked["epsilon_lower_bound"],
            "caught": checked["exceeds"],
        }
    return block


def audit_sentence(block: Mapping[str, Any], run_sample_rate: float) -> str:
    """The statement's sentence for an audit block: what ran, what it found, and what it could show."""
    m = block["mechanism"]
    claim = f"the ε = {block['claimed_epsilon']:.3g} claimed for those settings at δ = {block['delta']:.3g}"
    found = f"found ε ≥ {block['epsilon_lower_bound']:.3g} at {block['confidence']:.0%} confidence, " + (
        f"ABOVE {claim}: the implementation leaked more than it claims" if block["exceeds"] else f"below {claim}"
    )
    if block["max_auditable_epsilon"] <= block["claimed_epsilon"]:
        found += (
            f"; the most it could show is {block['max_auditable_epsilon']:.3g}, so it could not have refuted the claim"
        )
    else:
        found += f" (the most it could show: {block['max_auditable_epsilon']:.3g})"
    control = block.get("control_sensitivity_2x")
    power = ""
    if control is not None:
        power = f"; with every clip doubled the same audit found ε ≥ {control['epsilon_lower_bound']:.3g}, " + (
            "so it would catch such a bug"
            if control["caught"]
            else "so it could NOT catch such a bug at these settings"
        )
    return (
        f"{SENTENCE_START}a white-box one-run audit (Steinke et al. 2023) of dpzoo's implementation of this mechanism "
        f"(σ = {m['noise_multiplier']:.4g}, R = {m['max_grad_norm']:g}, {m['clipping']} clipping, {m['steps']} steps; "
        f"q = {m['sample_rate']:.4g} on the canary set against the run's {run_sample_rate:.4g}) with "
        f"{block['canaries']} canaries {found}{power}. It tests the implementation, not this model's data."
    )
