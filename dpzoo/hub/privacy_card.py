"""The privacy card of a saved model: its guarantee in a machine-readable block and in plain words.

:func:`dpzoo.save` writes ``README.md`` beside the weights: YAML front matter in the Hugging Face
model-card format (``library_name``, ``tags``) with a ``privacy:`` block (:func:`privacy_block`)
whose first fields are the concepts of the Differential Privacy Deployments Registry (Nanayakkara,
Ghazi & Vadhan, arXiv:2509.13509; OpenDP, November 2025): the DP flavour, ε and δ, the unit of
privacy and what it means here, the trust model, the accounting and the implementation, then
dpzoo's training fields (σ, q, steps, clipping, sampling, noise source, self-check, public
statistics, the composed history). The body is the plain-language statement
(:func:`statement_from_record`; ``dpzoo.privacy_statement`` of a model or directory), which also bounds what a membership-inference attacker can achieve
under the stated (ε, δ). ``docs/PRIVACY_CARD.md`` holds the schema (``docs/privacy_card.schema.json``)
and the field mapping.

:func:`check_card` is run on load: a card whose numbers disagree with the saved privacy record
(the JSON and the safetensors header), or whose ε does not recompute from its history with its
accountant, is refused.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from ..errors import CheckpointError
from ..versions import __version__

__all__ = [
    "CARD_NAME",
    "privacy_block",
    "statement_from_record",
    "membership_tpr_bound",
    "render_card",
    "read_card",
    "check_card",
    "same_value",
]

CARD_NAME = "README.md"
CARD_VERSION = 1  # the wording of the statement: bump it when statement_from_record's text changes
# privacy_unit -> (the unit's name on the card, what one unit is)
UNITS = {
    "sample": ("example", "one training example: adding or removing any one example"),
    "user": ("user", "one user: adding or removing all of one user's examples at once"),
    "sequence": ("sequence", "one sequence: adding or removing any one training sequence"),
}
# the fields a card must agree on with the record it was written from
CHECKED = ("epsilon", "delta", "accountant", "steps", "sample_rate", "noise_multiplier", "max_grad_norm")
FLAVOUR = "approximate DP, (ε, δ)"
TRUST_MODEL = "central: one trusted party trains on the raw data and releases the model"


def membership_tpr_bound(epsilon: float, delta: float, fpr: float = 0.01) -> float:
    """The largest true-positive rate any membership test can reach at false-positive rate ``fpr``
    against an (ε, δ)-DP mechanism: min(e^ε·α + δ, 1 − e^−ε·(1 − δ − α)) (the hypothesis-testing
    region of (ε, δ)-DP; Kairouz, Oh & Viswanath, ICML 2015, Thm. 2.1)."""
    if not math.isfinite(epsilon):
        return 1.0
    return float(min(1.0, math.exp(epsilon) * fpr + delta, 1 - math.exp(-epsilon) * (1 - delta - fpr)))


MECHANISM = "DP-SGD (Gaussian, Poisson sampling)"


def _accounting(accountant: str) -> dict[str, Any]:
    from ..privacy.accounting.registry import accountant_spec

    try:
        spec = accountant_spec(accountant)
    except Exception:  # noqa: BLE001 - an accountant registered in another process
        return {"accountant": accountant, "library": "not registered here", "library_version": None}
    library = "opacus" if spec.requires and spec.requires.startswith("opacus") else "dp-accounting"
    if not spec.description.startswith(("dp-accounting", "Opacus")):
        library = spec.description or "user-registered"
    try:
        version = importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {"accountant": accountant, "library": library, "library_version": version}


def _versions(record: Mapping[str, Any], versions: Mapping[str, Any] | None) -> dict[str, Any]:
    """The software that wrote a card: this process's, or (``versions``, read back from a card) the
    accounting library and dpzoo versions it recorded; every other field comes from the record."""
    if versions is None:
        acc = _accounting(record["accountant"])
        return {"library": acc["library"], "library_version": acc["library_version"], "dpzoo": __version__}
    return dict(versions)


def privacy_block(
    record: Mapping[str, Any], audit: Mapping[str, Any] | None = None, versions: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The card's ``privacy:`` block of a saved privacy record (``dpzoo.privacy_metadata``)."""
    v = _versions(record, versions)
    unit, meaning = UNITS.get(record.get("privacy_unit", "sample"), (record.get("privacy_unit"), "one unit"))
    eps = record["epsilon"]
    block: dict[str, Any] = {
        "flavour": FLAVOUR,
        "epsilon": eps if math.isfinite(eps) else "inf",
        "delta": record["delta"],
        "unit_of_privacy": unit,
        "unit_meaning": meaning,
        "trust_model": TRUST_MODEL,
        "accounting": {
            "accountant": record["accountant"],
            "library": v["library"],
            "library_version": v["library_version"],
        },
        "implementation": {"name": "dpzoo", "version": v["dpzoo"], "mechanism": MECHANISM},
        "accountant": record["accountant"],
        "steps": record["steps"],
        "sample_rate": record["sample_rate"],
    }
    for key in ("users", "max_examples_per_user", "noise_multiplier", "max_grad_norm", "clipping", "sampling"):
        if key in record:
            block[key] = record[key]
    for key in ("noise", "self_check", "history"):
        if key in record:
            block[key] = record[key]
    block["public_statistics"] = record.get("public_statistics", "none recorded")
    if "delta_note" in record:
        block["delta_note"] = record["delta_note"]
    if audit is not None:
        block["audit"] = dict(audit)
    return block


SCOPE = (
    "This statement covers the model's weights. A training run's own outputs (its metrics: accuracy on "
    "held-out data, the dataset's size) are not protected by it."
)


def _strength(record: Mapping[str, Any], v: Mapping[str, Any], fpr: float) -> str:
    eps, delta, history = record["epsilon"], record["delta"], record.get("history") or []
    library = f"{v['library']} {v['library_version'] or ''}".strip()
    if len(history) > 1:  # e.g. a private item prior, or an earlier run on the same data, composed
        source = (
            f"over {len(history)} composed releases ({sum(int(h[2]) for h in history)} steps in all; each one's "
            "noise multiplier, sampling rate and steps are in the card's history)"
        )
    else:
        source = f"over {record['steps']} steps at sampling rate q = {record['sample_rate']:.4g}" + (
            f" and noise multiplier σ = {record['noise_multiplier']:.4g}" if "noise_multiplier" in record else ""
        )
    tpr = membership_tpr_bound(eps, delta, fpr)
    return (
        f"How strongly: (ε = {eps:.3g}, δ = {delta:.3g})-differential privacy, from the {record['accountant']} "
        f"accountant ({library}) {source}"
        + (f", clipping norm R = {record['max_grad_norm']:g}" if "max_grad_norm" in record else "")
        + f". For a membership-inference attacker this means: at a {fpr:.0%} false-positive rate, no test "
        f"can reach a true-positive rate above {tpr:.1%} (a guess reaches {fpr:.0%})"
        + ("; at this ε the (ε, δ) statement alone does not limit such an attacker at that rate." if tpr > 0.5 else ".")
    )


def statement_from_record(
    record: Mapping[str, Any] | None,
    fpr: float = 0.01,
    versions: Mapping[str, Any] | None = None,
    audit: Mapping[str, Any] | None = None,
) -> str:
    """The guarantee of a privacy record in plain words (None: a model without one); ``audit``: the
    card's audit block (:mod:`dpzoo.audit.of_record`), said in a sentence of its own."""
    if record is None:
        return "No differential-privacy guarantee is recorded for this model: treat it as trained without DP."
    v = _versions(record, versions)
    seeded = [k for k in ("noise", "sampling") if "reproducible" in str(record.get(k, ""))]
    failed = str(record.get("self_check", "")).startswith("failed")
    lines = []
    if not math.isfinite(record["epsilon"]):
        lines.append(
            f"Trained by dpzoo {v['dpzoo']} with DP-SGD's clipping but without noise: NO differential-privacy "
            "guarantee (ε is infinite). Treat it as trained without DP."
        )
    else:
        _, meaning = UNITS.get(record.get("privacy_unit", "sample"), (None, f"one {record.get('privacy_unit')}"))
        lines += [
            f"Trained with differential privacy by dpzoo {v['dpzoo']} (DP-SGD).",
            f"What is protected: {meaning}.",
            "Against whom: anyone who sees the released model, and even anyone who saw every noisy update during "
            "training (DP-SGD's analysis covers all of them); the party that trained it holds the data (central DP)"
            + (
                f"; NOT against anyone who holds the {' and '.join(seeded)} seed (recorded as reproducible)."
                if seeded
                else "."
            ),
            _strength(record, v, fpr),
        ]
    covered = record.get("public_statistics")
    lines += [
        "Not covered: "
        + (f"{covered} (used outside ε, assumed public)." if covered else "nothing recorded outside ε.")
        + (f" Note: {record['delta_note']}." if "delta_note" in record else ""),
        f"Noise: {record.get('noise', 'not recorded')}; sampling: {record.get('sampling', 'not recorded')}; "
        f"self-check: {record.get('self_check', 'not recorded')}" + (": the stated ε may not hold." if failed else "."),
    ]
    if audit is not None:
        from ..audit.recorded import audit_sentence

        lines.append(audit_sentence(audit, record["sample_rate"]))
    lines.append(SCOPE)
    return "\n".join(lines)


def render_card(
    model_name: str,
    record: Mapping[str, Any] | None,
    audit: Mapping[str, Any] | None = None,
    base_model: str | None = None,
    datasets: Sequence[str] | None = None,
) -> str:
    """README.md of a saved model: front matter (``base_model``: the pretrained tag it started from;
    ``datasets``: the named datasets it was trained on; the privacy block when there is a record)
    and the statement."""
    private = record is not None and math.isfinite(record["epsilon"])
    front: dict[str, Any] = {
        "library_name": "dpzoo",
        "tags": ["dpzoo", *(["differential-privacy", "dp-sgd"] if private else [])],
        "dpzoo_model": model_name,
        "dpzoo_card_version": CARD_VERSION,
    }
    if base_model:
        front["base_model"] = base_model
    if datasets:
        front["datasets"] = list(datasets)
    if record is not None:
        front["privacy"] = privacy_block(record, audit)
    body = yaml.safe_dump(front, sort_keys=False, allow_unicode=True)
    return f"---\n{body}---\n\n# {model_name}\n\n{statement_from_record(record, audit=audit)}\n"


def _card_parts(directory: str | Path) -> tuple[dict[str, Any] | None, str] | None:
    """(front matter or None, the text after it) of ``directory``'s card; None without a card. A
    byte-order mark and Windows line endings are read as what they are."""
    path = Path(directory) / CARD_NAME
    if not path.is_file():
        return None
    text = path.read_bytes().decode("utf-8-sig", errors="replace").replace("\r\n", "\n")
    if not text.startswith("---\n") or "\n---\n" not in text[3:]:
        return None, text
    end = text.index("\n---\n", 3)
    try:
        front = yaml.safe_load(text[4:end])
    except yaml.YAMLError as e:
        raise CheckpointError(f"{path}: its front matter is not YAML ({str(e).splitlines()[0]}).") from None
    return (front if isinstance(front, dict) else None), text[end + 5 :]


def read_card(directory: str | Path) -> dict[str, Any] | None:
    """The front matter of ``directory``'s card, or None when it has none."""
    parts = _card_parts(directory)
    return None if parts is None else parts[0]


def check_card(directory: str | Path, record: Mapping[str, Any] | None, header: Mapping[str, Any] | None) -> None:
    """Refuse a card that says something else than the saved record and the weights' header (its
    privacy block, field by field, and, for a card of this :data:`CARD_VERSION`, its statement), or
    whose ε does not recompute from its history with its accountant (when that accountant is
    registered in this process). A missing card claims nothing."""
    parts = _card_parts(directory)
    if parts is None:
        return
    front, body = parts
    card = (front or {}).get("privacy")
    path = Path(directory) / CARD_NAME
    if record is None:
        if card is not None:
            raise CheckpointError(f"{path} states a privacy guarantee that dpzoo_config.json does not hold.")
        return
    if card is None:
        raise CheckpointError(
            f"{path} states no privacy guarantee, but the model carries one: rewrite it with dpzoo.save."
        )
    versions = _card_versions(card)
    from ..audit.recorded import stated_audits

    audited = card.get("audit") is None or _check_audit(Path(directory), card["audit"], record)  # False: being replaced
    if audited and stated_audits(body) != (card.get("audit") is not None):
        raise CheckpointError(
            f"{path}: its text states an audit its audit block does not hold; rewrite it with dpzoo.save."
        )
    expected = privacy_block(record, card.get("audit"), versions)
    for source, other in (("the saved record", expected), ("the safetensors header", header)):
        if other is None:
            raise CheckpointError(f"{path} states a privacy guarantee that {source} does not hold.")
        keys = expected if source == "the saved record" else {k: None for k in CHECKED if k in other}
        for key in [*keys, *(k for k in card if k not in expected)]:
            mine, theirs = card.get(key), other.get(key)
            if source != "the saved record" and key == "epsilon" and mine == "inf":
                mine = math.inf  # the header reads an infinite ε back as a float
            if not same_value(mine, theirs):
                raise CheckpointError(
                    f"{path} says {key} = {mine!r} but {source} says {theirs!r}: the card was edited or belongs to "
                    "other weights; rewrite it with dpzoo.save."
                )
    version = (front or {}).get("dpzoo_card_version")  # numbers the statement's wording, which is checked
    if not isinstance(version, int) or isinstance(version, bool) or version != CARD_VERSION:
        raise CheckpointError(
            f"{path}: dpzoo_card_version {version!r} is not one this dpzoo can check; rewrite it with dpzoo.save."
        )
    stated = statement_from_record(record, versions=versions, audit=card.get("audit")) if audited else ""
    if " ".join(stated.split()) not in " ".join(body.split()):
        raise CheckpointError(
            f"{path}: its text does not state the saved record's guarantee (edited?); rewrite it with dpzoo.save."
        )
    _recompute(path, card)


def _card_versions(card: Mapping[str, Any]) -> dict[str, Any]:
    acc, impl = card.get("accounting") or {}, card.get("implementation") or {}
    if not isinstance(acc, Mapping) or not isinstance(impl, Mapping):
        return {"library": None, "library_version": None, "dpzoo": None}
    return {"library": acc.get("library"), "library_version": acc.get("library_version"), "dpzoo": impl.get("version")}


def check_saved_card(directory: Path, record: Mapping[str, Any] | None, weights: Path) -> None:
    """:func:`check_card` for a directory :func:`dpzoo.save` wrote (``weights``: its safetensors file;
    a sharded checkpoint has no single header, and the record stands for it)."""
    from safetensors import SafetensorError, safe_open

    from .privacy_record import privacy_from_header

    header = record
    if weights.is_file():
        try:
            with safe_open(str(weights), framework="pt") as f:
                header = privacy_from_header(f.metadata(), str(weights))
        except SafetensorError:
            return  # a corrupt weights file is refused when the weights are read
    check_card(directory, record, header)


def same_value(a, b) -> bool:
    """Equal, numbers up to float rounding (and a number another YAML writer left as a string)."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, str) and isinstance(b, (int, float)) and not isinstance(b, bool):
        try:
            a = float(a)
        except ValueError:
            return False
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return a == b or (math.isfinite(a) and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12))
    return a == b


def _recompute(path: Path, card: Mapping[str, Any]) -> None:
    from ..privacy.accounting.accountant import Accountant
    from ..privacy.accounting.registry import accountant_spec

    history, eps = card.get("history"), card.get("epsilon")
    if not history or eps == "inf":
        return
    try:
        accountant_spec(card["accountant"])
    except Exception:  # noqa: BLE001 - registered elsewhere: nothing to recompute with here
        return
    acc = Accountant(card["accountant"], [list(h) for h in history])
    again = acc.get_epsilon(card["delta"])
    if not math.isclose(again, eps, rel_tol=1e-6, abs_tol=1e-9):
        raise CheckpointError(
            f"{path} says ε = {eps} but its history gives ε = {again:.6g} with the {card['accountant']} accountant: "
            "the card was edited; rewrite it with dpzoo.save."
        )


def _check_audit(directory: Path, card_audit: Any, record: Mapping[str, Any]) -> bool:
    """Refuse a card's audit block that is not the verified block of ``dpzoo_audit.json`` beside
    it. False (nothing checked) while the block is being replaced (``replacing_audit``)."""
    from ..audit.recorded import AUDIT_FILE, replacing, verified_block

    if replacing():
        return False
    path, file = directory / CARD_NAME, directory / AUDIT_FILE
    try:
        saved = json.loads(file.read_text())
    except (OSError, ValueError):
        raise CheckpointError(
            f"{path} states an audit that {file.name} does not hold: rerun `dpzoo audit --run`."
        ) from None
    if not same_value(card_audit, verified_block(saved, record)):
        raise CheckpointError(f"{path}: its audit block is not {file.name}'s (edited?); rerun `dpzoo audit --run`.")
    return True
