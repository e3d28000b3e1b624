"""A saved private model as a draft record of the Differential Privacy Deployments Registry.

The registry (OpenDP, November 2025; Nanayakkara, Ghazi & Vadhan, arXiv:2509.13509; the data and
its schema in github.com/opendp/deployments-registry-data) describes each deployment in a
hierarchical YAML record. :func:`registry_record` fills every field that the privacy record
determines, under the field names of the registry's record template
(``tests/good_deployments/template.yaml``, the layout with ``basic``, ``dp_variant``,
``privacy_loss``, ``deployment_model``, ``implementation`` and ``administrative``:
:data:`TEMPLATE_LAYOUT` names the version), and leaves empty what only the publisher knows (who
curates the data, its intended use, region and sector). ``dpzoo card DIR --registry`` prints it,
ready to complete and submit as a draft. The registry's schema is still changing (its repository
holds records of two layouts); docs/PRIVACY_CARD.md maps each field.
"""

from __future__ import annotations

import datetime
import math
from typing import Any, Mapping

from ..errors import PrivacyUsageError
from .privacy_card import FLAVOUR, TRUST_MODEL, UNITS, statement_from_record

__all__ = ["registry_record", "TEMPLATE_LAYOUT"]

TEMPLATE_LAYOUT = "opendp/deployments-registry-data tests/good_deployments/template.yaml at commit 057e5d8"
_UNIT_NAMES = {"example": "Example-level", "user": "User-level", "sequence": "Sequence-level"}


def registry_record(
    record: Mapping[str, Any],
    model_name: str,
    audit: Mapping[str, Any] | None = None,
    publication_date: str | None = None,
) -> dict[str, Any]:
    """The registry record of a model with privacy ``record`` (``dpzoo.privacy_metadata``),
    ``audit`` its card's audit block, if any. Refused for a record without noise:
    there is no deployment of DP to register."""
    if not math.isfinite(record["epsilon"]):
        raise PrivacyUsageError("This model was trained without noise (ε = ∞): it has no DP guarantee to register.")
    unit, meaning = UNITS.get(record.get("privacy_unit", "sample"), (record.get("privacy_unit"), "one unit"))
    loss: dict[str, Any] = {
        "privacy_unit": _UNIT_NAMES.get(unit, f"{unit}-level"),
        "privacy_unit_details": meaning,
    }
    if "users" in record:
        loss["number_of_privacy_units"] = int(record["users"])
    loss["privacy_parameters"] = {"epsilon": float(record["epsilon"]), "delta": float(record["delta"])}
    loss["privacy_parameters_details"] = _parameter_details(record)
    history = record.get("history") or []
    per_example = any(len(h) > 3 for h in history)  # user-level DP by example-level sampling: clipped per example
    published = "the sampling rate q" + (" and the number of users N" if "users" in record else "")
    unprotected = f"{published} (published without noise)" + (
        f"; {record['public_statistics']}" if record.get("public_statistics") else ""
    )
    return {
        "url_slug": model_name.lower().replace(" ", "-"),
        "deployment": {
            "basic": {
                "name": model_name,
                "data_curators": [{"data_curator_name": "", "data_curator_type": ""}],
                "description": f"{model_name}, a model trained with DP-SGD by dpzoo",
                "intended_use": "",
                "data_product_type": "Machine learning model",
                "data_product_region": "",
                "publication_date": publication_date or datetime.date.today().isoformat(),
            },
            "dp_variant": {
                "variant_name": "Approximate DP",
                "data_domain": "the training set, as a collection of privacy units (" + meaning + ")",
                "unprotected_quantities": unprotected,
            },
            "privacy_loss": loss,
            "deployment_model": {
                "model_name": "Central",
                "model_name_details": TRUST_MODEL,
                "trust_assumptions": f"the trainer holds the raw data; noise: {record.get('noise', 'not recorded')}; "
                f"sampling: {record.get('sampling', 'not recorded')}",
                "actors": "anyone who sees the released model, or every noisy update made during training",
                "release_type": "Many releases" if len(history) > 1 else "One release",
                "release_type_details": f"{len(history)} releases composed into ε (the card's history)"
                if len(history) > 1
                else "the model, released once",
                "data_source_type": "Static",
                "access_type": "Non-interactive",
            },
            "implementation": {
                "preprocessing_and_hyperparameter_tuning": "not recorded by dpzoo: hyperparameter searches on the "
                "private data are outside ε unless accounted for by the publisher",
                "mechanisms": f"DP-SGD ({FLAVOUR}): Gaussian noise on the sum of per-"
                f"{'example' if per_example else unit} clipped gradients, "
                f"Poisson sampling ({record.get('clipping', 'abadi')} clipping at R = {record.get('max_grad_norm')}); "
                "implemented by dpzoo with per-sample norms exact against brute force and a rounding-error bound "
                "in the clip factors",
                "composition": f"{record['accountant']} accountant over the history {record.get('history')}",
                "post_processing": "the released weights; the model's outputs are post-processing",
                "justification": f"self-check: {record.get('self_check', 'not recorded')}"
                + (f"; {_audit_text(audit)}" if audit else ""),
                "additional_information": statement_from_record(record, audit=audit).replace("\n", " "),
            },
            "administrative": {"status": "Draft", "registry_authors": [""], "tier": 3},
        },
    }


def _parameter_details(record: Mapping[str, Any]) -> str:
    history = record.get("history") or []
    if len(history) > 1 or any(len(h) > 3 for h in history):  # composed releases, or k examples per user
        entries = "; ".join(
            f"σ = {h[0]:.4g}, q = {h[1]:.4g}, {h[2]} steps" + (f", k = {h[3]} examples per user" if len(h) > 3 else "")
            for h in history
        )
        return f"ε at δ = {record['delta']:g} for every release composed: {entries}"
    parts = [f"ε at δ = {record['delta']:g} for every release composed ({record['steps']} steps"]
    if "noise_multiplier" in record:
        parts.append(f", σ = {record['noise_multiplier']:.4g}")
    parts.append(f", q = {record['sample_rate']:.4g})")
    return "".join(parts)


def _audit_text(audit: Mapping[str, Any]) -> str:
    text = (
        f"empirical audit ({audit['method']}) of the implementation at this mechanism's settings: ε ≥ "
        f"{audit['epsilon_lower_bound']:.3g} at {audit['confidence']:.0%} confidence against {audit['claimed_epsilon']:.3g} "
        f"claimed (the most it could show: {audit['max_auditable_epsilon']:.3g})"
    )
    if audit["exceeds"]:
        text += "; the bound EXCEEDS the claim: the implementation leaked more than it claims"
    elif audit["max_auditable_epsilon"] <= audit["claimed_epsilon"]:
        text += "; it could not have refuted the claim"
    control = audit.get("control_sensitivity_2x")
    if control is not None:
        text += "; a doubled clip was " + (
            "caught" if control["caught"] else "NOT caught: it cannot vouch at these settings"
        )
    return text
