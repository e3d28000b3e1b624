"""The privacy accountant: ε at δ of a (σ, q, steps) history, and its inverse (σ for a target ε).

The accountant keeps the history of (noise multiplier σ, sample rate q, steps) for the
Poisson-subsampled Gaussian mechanism, as Opacus does; ε is computed from that history by
the library when asked (every entry composed) — never by a hand-written accountant: the
libraries are dp-accounting's RDP and PLD accountants and Opacus' PRV, RDP and Gaussian-DP
ones (:mod:`dpzoo.privacy.accounting.backends`, with the analyses they implement), looked up by
name in the registry (:mod:`dpzoo.privacy.accounting.registry`). :func:`get_noise_multiplier`
inverts that ε: the smallest σ whose ε, composed after a history, meets a target.

``"gdp"`` (Opacus' ``GaussianAccountant``, Bu, Dong, Long & Su 2020) is an approximation, not a
bound, and only reads the *last* (σ, q, steps) of a history: dpzoo refuses it for any history
with more than one distinct (σ, q) (:class:`~dpzoo.errors.AccountingError`), e.g. DP-FROST's
selection followed by training, or a run resumed with another σ.

The history is the accountant's state: it is saved in training checkpoints and restored on
resume. This module also exports the registry's names (``ACCOUNTANTS``,
:func:`register_accountant`, :func:`unregister_accountant`, :func:`accountant_spec`,
:class:`AccountantSpec`), so ``dpzoo.privacy.accounting.accountant`` is the one import for accounting.
"""

from __future__ import annotations

import importlib
import logging
import math
import numbers
from typing import Iterable

from ...errors import AccountingError, MissingDependencyError
from ..provenance import run_id
from .registry import ACCOUNTANTS, AccountantSpec, accountant_spec, register_accountant, unregister_accountant

__all__ = [
    "Accountant",
    "ACCOUNTANTS",
    "AccountantSpec",
    "register_accountant",
    "unregister_accountant",
    "accountant_spec",
    "get_noise_multiplier",
]

_MULTI = "use accountant='pld' or 'rdp' (dp-accounting) or 'prv' (Opacus), which compose every entry"
GROUP_ACCOUNTANTS = ("pld",)  # compose [σ, q, steps, k] entries (dp-accounting's mixture-of-Gaussians PLD)


def _number(value, arg: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        try:  # 0-d tensors and arrays
            value = value.item()
        except (AttributeError, ValueError, TypeError):
            raise AccountingError(f"{arg} must be a real number, got {value!r}.") from None
    return float(value)


def _entry(noise_multiplier, sample_rate, steps, group=1) -> list:
    """A validated [σ, q, steps] history entry, or [σ, q, steps, k] for steps where each of a
    user's k examples is Poisson-sampled at q (user-level DP by example-level sampling: the
    user's contribution is a mixture of Gaussians, :mod:`dpzoo.privacy.accounting.backends`)."""
    sigma = _number(noise_multiplier, "noise_multiplier")
    if not (math.isfinite(sigma) and sigma >= 0):
        raise AccountingError(f"noise_multiplier must be a finite number >= 0 (0 = no noise, ε = ∞), got {sigma}.")
    q = _number(sample_rate, "sample_rate")
    if not 0 < q <= 1:
        raise AccountingError(f"sample_rate must be in (0, 1] (batch size / dataset size), got {q}.")
    n = _number(steps, "steps")
    if not (math.isfinite(n) and n >= 0 and n == int(n)):
        raise AccountingError(f"steps must be a whole number >= 0, got {steps!r}.")
    k = _number(group, "group")
    if not (k >= 1 and k == int(k)):
        raise AccountingError(f"the examples per user of a history entry must be a whole number >= 1, got {group!r}.")
    return [sigma, q, int(n)] if k == 1 else [sigma, q, int(n), int(k)]


def _row(h) -> list:
    try:
        sigma, q, steps, *group = h
    except (TypeError, ValueError):
        group = [None, None]
    if len(group) > 1:
        raise AccountingError(
            f"a history entry must be (noise_multiplier, sample_rate, steps[, examples per user]), got {h!r}."
        )
    return _entry(sigma, q, steps, *group)


def _check_delta(delta, arg: str = "delta") -> float:
    d = _number(delta, arg)
    if not 0 < d < 1:
        raise AccountingError(f"{arg} must be in (0, 1) (typically < 1 / dataset size), got {delta!r}.")
    return d


def _spent(history: list) -> list:
    return [h for h in history if h[2] > 0]


def _registered(name: str) -> AccountantSpec | None:
    """The spec of ``name``, or None once it is no longer registered (:func:`unregister_accountant`)."""
    return accountant_spec(name) if name in ACCOUNTANTS else None


def _label(name: str) -> str:
    spec = _registered(name)
    return f"accountant={name!r}" + (f" ({spec.description})" if spec is not None and spec.description else "")


def _composes(name: str) -> bool:
    spec = _registered(name)
    return spec is None or spec.composes_history


def _check_single(name: str, history: list) -> None:
    """An accountant that does not compose (``"gdp"``: Opacus reads ``history[-1]`` only): refuse
    a history with more than one (σ, q), which it would under-report. Entries of k examples per
    user need an accountant of the mixture of Gaussians (:data:`GROUP_ACCOUNTANTS`)."""
    if name not in GROUP_ACCOUNTANTS and any(len(h) > 3 for h in _spent(history)):
        raise AccountingError(
            f"{_label(name)} cannot account steps where a user's k examples are each sampled (user-level DP by "
            "example-level sampling: a mixture of Gaussians): use accountant='pld' (dp-accounting), or "
            "user-level sampling (user_sampling='users'), which any accountant composes."
        )
    if _composes(name):
        return
    distinct = list(dict.fromkeys((h[0], h[1]) for h in _spent(history)))
    if len(distinct) > 1:
        shown = ", ".join(f"(σ={s:.4g}, q={q:.4g})" for s, q in distinct[:4]) + (", …" if len(distinct) > 4 else "")
        raise AccountingError(
            f"{_label(name)} only counts the last (σ, q) of a history and would under-report ε for {shown}: {_MULTI}."
        )


class Accountant:
    """History of subsampled Gaussian steps and the library that turns it into (ε, δ)."""

    dpzoo_keeps_run_id = True  # its run id is an attribute; a copy is a new run (__setstate__)
    dpzoo_delta: float | None = None  # the δ of the engine's run (a record made from its links alone uses it)

    def __init__(self, name: str = "rdp", history: Iterable = (), group: int = 1):
        spec = accountant_spec(name)
        if spec.requires:
            try:
                importlib.import_module(spec.requires)
            except ImportError:
                raise MissingDependencyError(
                    f"The {name!r} accountant comes from {spec.install or spec.requires}, "
                    "or use accountant='pld' / 'rdp' (dp-accounting)."
                ) from None
        self.name = name
        self.history: list[list] = [_row(h) for h in history]
        self.group = group  # k of the steps :meth:`step` records (1: one unit per sampled row)
        _check_single(name, self.history)
        run_id(self)  # from the start: a copy pickled before anything asked for it still knows its original

    def check(self, noise_multiplier: float, sample_rate: float) -> None:
        """Raise :class:`~dpzoo.errors.AccountingError` if steps of (σ, q) could not be recorded
        (bad values, or an accountant that does not compose, such as ``"gdp"``, with another (σ, q)
        in the history); records nothing. For set-up
        code that wants the refusal before the first step."""
        entry = _entry(noise_multiplier, sample_rate, 1, self.group)
        _check_single(self.name, self.history + [entry])

    def step(self, noise_multiplier: float, sample_rate: float, steps: int = 1) -> None:
        """Record ``steps`` steps of the Poisson-subsampled Gaussian mechanism (σ, q), with each of
        a user's :attr:`group` examples sampled at q when it is > 1.

        With an accountant that does not compose (``"gdp"``), a (σ, q) other than the history's is
        refused here, before it is recorded (dpzoo's optimizer records a step before applying it)."""
        entry = _entry(noise_multiplier, sample_rate, steps, self.group)
        if entry[2] > 0:
            _check_single(self.name, self.history + [entry])
        last = self.history[-1] if self.history else None
        if last is not None and [last[0], last[1], *last[3:]] == [entry[0], entry[1], *entry[3:]]:
            self.history[-1][2] += entry[2]
        else:
            self.history.append(entry)

    @property
    def steps(self) -> int:
        return sum(h[2] for h in self.history)

    def get_epsilon(self, delta: float) -> float:
        """ε of everything recorded so far, at the given δ (every history entry composed)."""
        delta = _check_delta(delta)
        history = _spent(self.history)
        _check_single(self.name, history)
        if not history:
            return 0.0  # nothing released
        if any(h[0] == 0 for h in history):
            return math.inf
        eps = _epsilon(self.name, history, delta)
        if math.isnan(eps) or eps < 0:
            raise AccountingError(
                f"the {self.name!r} accountant returned ε = {eps} for the history {history} at "
                f"δ = {delta}: use another accountant ('pld' or 'rdp')."
            )
        return eps

    def state_dict(self) -> dict:
        """The name and history, with the run's identity (``run_id``, and the runs composed before its
        own steps, ``[[run id, steps], ...]``): a restore tells by them what it already counts
        (:func:`dpzoo.privacy.budget.restore_history`)."""
        return {
            "name": self.name,
            "history": [list(h) for h in self.history],
            "run_id": run_id(self),
            "composed_runs": [list(seg) for seg in getattr(self, "dpzoo_segments", None) or []],
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("name") != self.name:
            raise AccountingError(
                f"checkpoint accountant {state.get('name')!r} != this engine's {self.name!r}: "
                f"create the engine with accountant={state.get('name')!r}."
            )
        history = [_row(h) for h in state["history"]]
        _check_single(self.name, history)
        self.history[:] = history  # in place: a model's record of its spending refers to this list
        # the runs the loaded history is made of, so that later steps are told apart from them
        before = [list(seg) for seg in state.get("composed_runs") or []]
        key = state.get("run_id")
        own = sum(h[2] for h in history) - sum(n for _, n in before)
        if key != run_id(self) and own > 0:
            before.append([key if isinstance(key, str) and key else None, own])
        self.__dict__.setdefault("dpzoo_segments", [])[:] = before

    def __setstate__(self, state: dict) -> None:
        """A pickled or deep-copied accountant goes on apart from the original: a run of its own,
        which composed the original's steps so far (two copies that both go on both count)."""
        self.__dict__.update(state)
        original = self.__dict__.pop("dpzoo_run_id", None)
        if original is not None:
            before = [list(seg) for seg in self.__dict__.get("dpzoo_segments") or []]
            own = self.steps - sum(n for _, n in before)
            self.dpzoo_segments = before + ([[original, own]] if own > 0 else [])


def _epsilon(name: str, history: list, delta: float) -> float:
    absl = logging.getLogger("absl")
    level = absl.level
    # dp-accounting logs every fractional RDP order it cannot evaluate and then leaves it
    # out (the bound only gets looser): expected at small σ, not worth a warning each time
    absl.setLevel(logging.ERROR)
    try:
        return _library_epsilon(name, history, delta)
    finally:
        absl.setLevel(level)


def _library_epsilon(name: str, history: list, delta: float) -> float:
    spec = accountant_spec(name)
    entries = [tuple(h) for h in history]
    if not spec.composes_history:  # one (σ, q) (checked by the caller): the library reads one entry
        entries = [(entries[0][0], entries[0][1], sum(h[2] for h in entries))]
    return float(spec.epsilon(entries, delta))


def get_noise_multiplier(
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "rdp",
    tolerance: float = 0.01,
    history: Iterable = (),
    group: int = 1,
) -> float:
    """The smallest σ (to ``tolerance`` in ε) whose ε after ``steps`` steps is ≤ ``target_epsilon``.

    A bracket on σ, then a safeguarded regula falsi, with every ε computed by the chosen library
    accountant: the returned σ is one whose ε *that* accountant has checked to be ≤
    ``target_epsilon`` (RDP serves only as a first guess, and only without a history).
    ``history`` ((σ, q, steps) triples) is what has already been spent, e.g. DP-FROST's parameter
    selection: the new mechanism is composed after it (DP-FROST App. C, Algorithm 2). An accountant
    that cannot compose (``"gdp"``) refuses a non-empty history. ``group``: k examples of a user,
    each sampled at q (user-level DP by example-level sampling; accountant ``"pld"``).
    """
    eps_target, target_delta, tol, new, history = _calibration_inputs(
        target_epsilon, target_delta, sample_rate, steps, accountant, tolerance, history, group
    )
    sample_rate, steps = new[1], new[2]
    cache: dict[float, float] = {0.0: math.inf}

    def eps(sigma: float) -> float:
        if sigma not in cache:
            a = Accountant(accountant, history, group)
            a.step(sigma, sample_rate, steps)
            cache[sigma] = a.get_epsilon(target_delta)
        return cache[sigma]

    lo, hi = 0.0, 1.0
    if not _spent(history) and accountant not in ("rdp", "opacus-rdp") and len(new) == 3:
        # Speed-up only: dp-accounting's RDP σ for this single mechanism is a good first guess
        # (RDP's ε upper-bounds the tighter accountants'). Both brackets are checked with
        # `accountant` itself below. Not used after a history: RDP may find it already spent.
        try:
            hi = get_noise_multiplier(eps_target, target_delta, sample_rate, steps, "rdp", tol)
        except AccountingError:
            hi = 1.0
        else:
            lo = hi / 2
            while eps(lo) <= eps_target and lo > 1e-3:
                hi, lo = lo, lo / 2
            if eps(lo) <= eps_target:
                lo = 0.0
    while eps(hi) > eps_target:
        lo, hi = hi, hi * 2
        if hi > 1e4:
            raise AccountingError(
                f"target_epsilon={eps_target} is out of reach for accountant={accountant!r} "
                "(σ > 1e4 needed): raise target_epsilon or target_delta, take fewer steps, or use "
                "accountant='pld' (tightest; Opacus' RDP orders stop at 63)."
            )
    return _regula_falsi(eps, lo, hi, eps_target, tol)


def _calibration_inputs(target_epsilon, target_delta, sample_rate, steps, accountant, tolerance, history, group):
    """(ε target, δ, tolerance, the new mechanism's entry, the history), checked: refused when the
    history cannot be composed by ``accountant`` or already spends the target."""
    accountant_spec(accountant)  # an unknown name: AccountingError
    eps_target = _number(target_epsilon, "target_epsilon")
    if not (math.isfinite(eps_target) and eps_target > 0):
        raise AccountingError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}.")
    target_delta = _check_delta(target_delta, "target_delta")
    tol = _number(tolerance, "tolerance")
    if not (math.isfinite(tol) and tol > 0):
        raise AccountingError(f"tolerance (in ε) must be a finite number > 0, got {tolerance!r}.")
    new = _entry(1.0, sample_rate, steps, group)
    if new[2] < 1:
        raise AccountingError(f"steps must be a whole number >= 1 (the steps to calibrate σ for), got {steps!r}.")
    base = Accountant(accountant, history)
    _check_single(accountant, base.history + [new])
    if _spent(base.history):
        if not _composes(accountant):
            raise AccountingError(
                f"{_label(accountant)} cannot calibrate σ after a spent "
                f"history (it only counts the last (σ, q)): {_MULTI}."
            )
        spent = base.get_epsilon(target_delta)
        if spent >= eps_target:
            raise AccountingError(
                f"the history already spends ε = {spent:.3g} >= target_epsilon = {eps_target} "
                f"at δ = {target_delta}: nothing is left for {new[2]} more steps."
            )
    return eps_target, target_delta, tol, new, base.history


def _regula_falsi(eps, lo: float, hi: float, eps_target: float, tol: float) -> float:
    """Safeguarded regula falsi on log ε(log σ) (about linear), aiming at target - tol/2, with a
    bisection step whenever an interpolation did not halve the bracket. Invariant: eps(hi) <=
    target < eps(lo); only a σ whose ε was checked is returned."""
    goal = math.log(max(eps_target - tol / 2, eps_target / 2))
    interpolate = True
    while eps_target - eps(hi) > tol and hi - lo >= 1e-6:
        e_lo, e_hi, width = eps(lo), eps(hi), hi - lo
        if interpolate and lo > 0 and math.isfinite(e_lo) and e_hi > 0:
            a, b = math.log(e_lo) - goal, math.log(e_hi) - goal  # a > 0 > b
            mid = math.exp(math.log(lo) + a / (a - b) * (math.log(hi) - math.log(lo)))
            mid = min(max(mid, lo + width / 32), hi - width / 32)
        else:
            mid = (lo + hi) / 2
        if eps(mid) > eps_target:
            lo = mid
        else:
            hi = mid
        interpolate = hi - lo <= width / 2
    return hi
