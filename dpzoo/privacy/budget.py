"""The privacy a run spends, composed with what was spent before it: the sample rate q, the
history a model or a checkpoint carries (composed first), and σ, given or calibrated to spend
a target ε over the epochs (``make_private``, ``DPOptimizer.load_state_dict``)."""

from __future__ import annotations

import warnings

from ..errors import DPZooError, PrivacyUsageError, WeakPrivacyWarning
from .accounting.accountant import Accountant, get_noise_multiplier
from .caller import first_frame_outside_dpzoo
from .carried import (  # what a model carries: re-exported, so dpzoo.privacy.budget stays the one import
    link_spending,
    prior_segments,
    prior_spending,
    spent_inside,
)
from .provenance import distinct_histories, record_part, run_id, segments_of
from .spending import ComposedSpending, FollowingSpending, SpendingLink

__all__ = [
    "compute_sample_rate",
    "prior_spending",
    "SpendingLink",
    "ComposedSpending",
    "FollowingSpending",
    "link_spending",
    "spent_inside",
    "calibrate",
    "restore_history",
]


def compute_sample_rate(batch_size: int, world: int, n: int, unit: str = "samples") -> float:
    """q = batch_size · world / N: each rank Poisson-samples its shard at the one global rate
    (``unit``: what N counts, e.g. users)."""
    q = batch_size * world / n
    if q > 1:
        raise PrivacyUsageError(
            f"batch_size {batch_size}{f' x {world} ranks' if world > 1 else ''} exceeds the dataset's "
            f"{n} {unit} (sample rate q = {q:.3g} > 1): use a batch_size of at most "
            f"{n // world}."
        )
    return q


def calibrate(
    accountant: Accountant,
    prior: list,
    *,
    noise_multiplier,
    target_epsilon,
    target_delta,
    epochs,
    sample_rate: float,
    steps_per_epoch: int,
):
    """σ: ``noise_multiplier``, or the one that spends ``target_epsilon`` over ``epochs`` after the
    privacy the model already spent (``prior``, composed into ``accountant`` first). Refused if
    ``accountant`` cannot compose its history with (σ, q)."""
    if prior:  # the model already spent privacy on its data (dpzoo.load, an earlier engine): compose after it
        segments = getattr(prior, "segments", None)
        key, held = run_id(accountant), [list(h) for h in accountant.history]
        composed = distinct_histories(  # each run once: the model may carry this accountant's own run
            [
                ("prior", segments, list(prior)) if segments is not None else (None, None, list(prior)),
                (key, segments_of(key, prior_segments(accountant), held), held),
            ]
        )
        accountant.load_state_dict({"name": accountant.name, "history": list(composed)})
        # the runs composed before this run's next steps (records and checkpoints carry them)
        prior_segments(accountant)[:] = composed.segments
    if target_epsilon is not None:
        try:
            noise_multiplier = get_noise_multiplier(
                target_epsilon,
                target_delta,
                sample_rate,
                int(epochs) * steps_per_epoch,
                accountant.name,
                history=accountant.history,
                group=accountant.group,
            )
        except ValueError as e:
            if isinstance(e, DPZooError):
                raise
            raise PrivacyUsageError(f"Cannot calibrate the noise: {e}") from None
    accountant.check(float(noise_multiplier), sample_rate)  # e.g. a history this accountant cannot compose
    warn_weak_budget(float(noise_multiplier), target_epsilon)
    return noise_multiplier


WEAK_EPSILON = 100.0  # a target at or above it says little (DP training papers report ε ≤ 10)


def warn_weak_budget(noise_multiplier: float, target_epsilon: float | None) -> None:
    """A :class:`~dpzoo.errors.WeakPrivacyWarning` for no noise (ε = ∞) or a target ε ≥ 100."""
    if noise_multiplier == 0:
        warnings.warn(
            "noise_multiplier = 0: no noise, so ε = ∞ and the run is not differentially private (the metadata "
            "will say so). Use a target_epsilon or a noise_multiplier > 0.",
            WeakPrivacyWarning,
            stacklevel=first_frame_outside_dpzoo(),
        )
    elif target_epsilon is not None and target_epsilon >= WEAK_EPSILON:
        warnings.warn(
            f"target_epsilon = {target_epsilon:g}: a guarantee this weak says little (e^ε bounds how much more "
            "likely any outcome becomes with one sample); DP training usually targets ε ≤ 10.",
            WeakPrivacyWarning,
            stacklevel=first_frame_outside_dpzoo(),
        )


def restore_history(accountant: Accountant, state: dict) -> None:
    """Load the accountant history of an optimizer checkpoint ``state`` into ``accountant``,
    composed with what it already holds by run identity, never by equal values
    (:mod:`dpzoo.privacy.provenance`): of each run the most steps either holds (a checkpoint restored
    twice counts once; one of an unrelated run with the same history counts twice; a release this
    accountant recorded before the restore, such as a new DP-FROST selection, counts as well).
    Refused for a checkpoint of another accountant, or one that took steps but records no history."""
    if state.get("steps", 0) and "accountant" not in state:
        raise PrivacyUsageError(
            f"This optimizer checkpoint took {state['steps']} private steps but records no accountant history "
            "(saved by an older dpzoo): ε would restart from 0. Restore the history with "
            "engine.accountant.load_state_dict(...) from the run's engine.state_dict()."
        )
    if "accountant" not in state:
        return
    saved_state = state["accountant"]
    if saved_state.get("name") != accountant.name:
        raise PrivacyUsageError(
            f"The checkpoint was accounted with {saved_state.get('name')!r}, this engine uses "
            f"{accountant.name!r}: make the engine with the checkpoint's accountant."
        )
    saved = [list(h) for h in saved_state["history"]]
    key = run_id(accountant)
    now = [list(h) for h in accountant.history]
    before = prior_segments(accountant)
    history = distinct_histories([(key, segments_of(key, before, now), now), record_part(saved_state, saved)])
    accountant.load_state_dict({"name": accountant.name, "history": list(history)})
    before[:] = history.segments  # all of it composed before this run's own next steps
