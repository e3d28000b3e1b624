"""The privacy record of an engine's run (what ``dpzoo.save`` writes), and the check that its δ
means something: δ < 1/N.

A (ε, δ) guarantee with δ ≥ 1/N is met by a mechanism that publishes one random sample of the N
in the clear, so such a claim says nothing (Dwork & Roth, "The Algorithmic Foundations of
Differential Privacy", §2.3). dpzoo refuses it at ``make_private`` and ``get_epsilon`` unless the
user accepts it explicitly; the record then says so.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from ..errors import AccountingError, DPZooError
from .provenance import distinct_histories, run_id

if TYPE_CHECKING:
    from .engine import PrivacyEngine

__all__ = ["check_delta", "engine_record"]


def check_delta(delta: float, n: int | None, accepted: bool = False) -> None:
    """Refuse δ ≥ 1/N (``n`` samples) unless ``accepted``; nothing to check without ``n``."""
    if n and not accepted and delta >= 1.0 / n:
        raise AccountingError(
            f"delta = {delta:g} is at least 1/N = 1/{n}: a mechanism that publishes one privacy unit in the clear meets "
            f"such a guarantee, so the claim would say nothing. Use delta < 1/N, e.g. {_suggest(n):.0e} (--delta on the "
            "command line), or pass accept_large_delta=True to make_private (recorded in the privacy metadata)."
        )


def _suggest(n: int) -> float:
    """A round δ well below 1/N (the usual choice is δ ≪ 1/N, e.g. 1e-5 for N ≈ 50,000)."""
    d = 1e-5
    while d >= 0.1 / n:
        d /= 10
    return d


def engine_record(engine: "PrivacyEngine", delta: float | None) -> dict[str, Any]:
    """The privacy metadata of ``engine``'s run at ``delta``: ε, δ, accountant, steps, sample rate,
    σ, R, the secrecy of noise and sampling, the self-check's verdict, the whole (σ, q, steps)
    history, and what the user stated public or accepted."""
    if delta is None:
        raise DPZooError("privacy metadata needs delta: pass it, or target_delta to make_private.")
    eps = engine.get_epsilon(delta)
    if engine.noise_seed is None:
        noise = "secret (OS entropy)"
    else:
        noise = "reproducible (not private against anyone holding the seed)"
    unit = dict(engine.unit_record)
    sampling = unit.pop("sampling", "Poisson")
    if engine.sample_seed is None:
        sampling += ", secret (OS entropy)"
    else:
        sampling += ", reproducible (membership predictable from the seed)"
    optimizer = engine.optimizer
    if optimizer is not None and optimizer.refusal is not None:
        check = engine.self_check_result or f"failed: {optimizer.refusal}"  # and no step was taken since
    elif not engine.watch_self_check:
        check = "skipped by the user (self_check=False)"
    else:
        check = engine.self_check_result or "pending (no non-empty step yet)"
    record = {
        "epsilon": float(eps),
        "delta": float(delta),
        "accountant": engine.accountant.name,
        "steps": int(engine.steps),
        "sample_rate": float(engine.sample_rate),
        "noise_multiplier": float(engine.noise_multiplier),
        "max_grad_norm": float(engine.max_grad_norm),
        **unit,  # privacy_unit; for users also their number and k (max_examples_per_user)
        **({"clipping": optimizer.clipping} if optimizer is not None else {}),
        "noise": noise,
        "sampling": sampling,
        "self_check": check,
        # every (σ, q, steps) composed into ε, so a later run on the same data composes all of them
        "history": [list(h) for h in engine.accountant.history],
        "run_id": run_id(
            engine.accountant
        ),  # a later run that finds both this record and the run's link counts it once
        "composed_runs": [list(seg) for seg in getattr(engine.accountant, "dpzoo_segments", None) or []],
    }
    if engine.public_statistics:
        record["public_statistics"] = "; ".join(engine.public_statistics)
    kept = [part for m in (engine.module.modules() if engine.module is not None else ()) for part in
            getattr(getattr(m, "dpzoo_spending", None), "kept", None) or []]  # fmt: skip
    if kept:  # a run on data stated disjoint: what the model spent before, outside ε, for later runs to compose
        before = distinct_histories(kept)
        record["disjoint_spending"] = {
            "history": list(before),
            "run_id": uuid.uuid4().hex,
            "composed_runs": before.segments,
        }
    from ..integrations.peft_statements import unknown_origin_note  # imports nothing heavy; not at import time

    note = unknown_origin_note(engine.module) if engine.module is not None else None
    if note:  # a reload must stay refused as the model in memory is
        record["unknown_origin"] = note
    if engine.dataset_size and delta >= 1.0 / engine.dataset_size:
        record["delta_note"] = (
            f"delta >= 1/N (N = {engine.dataset_size}) accepted by the user (accept_large_delta=True): "
            "the guarantee allows releasing one privacy unit's data (a sample, or a user's) in the clear"
        )
    return record
