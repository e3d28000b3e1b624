"""Privacy accounting through established libraries (never a hand-written accountant).

* ``"rdp"`` (default: fast and conservative): Rényi DP of the Poisson-subsampled Gaussian
  (Mironov 2017; Mironov, Talwar & Zhang 2019), ``dp_accounting.rdp.RdpAccountant``;
* ``"pld"``: privacy loss distributions (Koskela et al. 2020; Doroshenko et al. 2022),
  ``dp_accounting.pld.PLDAccountant`` with its default pessimistic discretisation — tight;
  both from Google's dp-accounting, a core dependency;
* ``"prv"``: privacy loss random variables (Gopi, Lee & Wutschitz 2021), Opacus'
  ``PRVAccountant`` (its ε upper bound);
* ``"opacus-rdp"``: Opacus' ``RDPAccountant`` (the same analysis as ``"rdp"``, Opacus' orders);
* ``"gdp"``: Opacus' ``GaussianAccountant``, Gaussian DP via the central limit theorem
  (Bu, Dong, Long & Su 2020). An *approximation*, not a bound (Opacus warns that it can
  underestimate ε), and it only reads the *last* (σ, q, steps) of a history: dpzoo refuses it
  for any history with more than one distinct (σ, q) (:class:`~dpzoo.errors.AccountingError`),
  e.g. DP-FROST's selection followed by training, or a run resumed with another σ.

Opacus' accountants come with ``pip install "dpzoo[opacus]"``.

Accountants are registered (:func:`register_accountant`, the built-ins above too): a name, a
function turning a (σ, q, steps) history into ε at δ through a library, whether it composes a
multi-entry history and whether its ε is an upper bound (the engine refuses one that is not).
``ACCOUNTANTS`` is a live view of the registered names.

The accountant keeps the history of (noise multiplier σ, sample rate q, steps) for the
Poisson-subsampled Gaussian mechanism, as Opacus does; ε is computed from that history by
the library when asked (every entry composed). The history is the accountant's state: it is
saved in training checkpoints and restored on resume.
"""

from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, Iterable

from ..errors import AccountingError

__all__ = [
    "Accountant",
    "ACCOUNTANTS",
    "AccountantSpec",
    "register_accountant",
    "accountant_spec",
    "get_noise_multiplier",
]

_MULTI = "use accountant='pld' or 'rdp' (dp-accounting) or 'prv' (Opacus), which compose every entry"


@dataclass(frozen=True)
class AccountantSpec:
    """One registered accountant (see :func:`register_accountant`).

    ``epsilon(history, delta)`` turns a (σ, q, steps) history of the Poisson-subsampled Gaussian
    mechanism (tuples, every entry with steps > 0 and σ > 0) into ε at δ through a library.
    ``composes_history=False``: the library counts one (σ, q) only; dpzoo then refuses any
    history with a second distinct (σ, q) and hands ``epsilon`` a single entry (the steps summed).
    ``upper_bound=False``: ε is an approximation that may under-report; the
    :class:`~dpzoo.PrivacyEngine` refuses it for training (``caveat`` says why). ``requires``:
    a module imported when an :class:`Accountant` of this name is created (``install`` says how to
    get it when the import fails).
    """

    name: str
    epsilon: Callable[[list, float], float]
    composes_history: bool = True
    upper_bound: bool = True
    requires: str | None = None
    install: str | None = None
    description: str = ""
    caveat: str = ""


_REGISTRY: dict[str, AccountantSpec] = {}


class _Names(Sequence):
    """A live, read-only view of the registered accountants' names (in registration order)."""

    def __init__(self, registry: dict):
        self._registry = registry

    def __getitem__(self, i):
        return tuple(self._registry)[i]

    def __len__(self) -> int:
        return len(self._registry)

    def __contains__(self, name) -> bool:
        return isinstance(name, str) and name in self._registry

    def __iter__(self):
        return iter(tuple(self._registry))

    def __eq__(self, other) -> bool:
        return tuple(self) == (tuple(other) if isinstance(other, (tuple, list, _Names)) else other)

    def __repr__(self) -> str:
        return repr(tuple(self))


ACCOUNTANTS = _Names(_REGISTRY)  # names of every registered accountant (a view: registrations show up)


def register_accountant(
    name: str,
    epsilon_fn: Callable[[list, float], float],
    *,
    composes_history: bool = True,
    requires: str | None = None,
    upper_bound: bool = True,
    install: str | None = None,
    description: str = "",
    caveat: str = "",
    replace: bool = False,
) -> AccountantSpec:
    """Register an accountant under ``name`` (as Opacus registers its accountants).

    ``epsilon_fn(history, delta) -> ε`` computes ε at δ for a (σ, q, steps) history, each entry
    with σ > 0 and steps > 0, through a library (dpzoo computes no ε itself); see
    :class:`AccountantSpec` for the flags. Afterwards ``Accountant(name)``,
    ``PrivacyEngine(accountant=name)`` (if ``upper_bound``), ``get_noise_multiplier(...,
    accountant=name)`` and ``dpzoo train --accountant name`` accept it. A name already registered
    is refused unless ``replace=True``. Returns the :class:`AccountantSpec`.
    """
    if not isinstance(name, str) or not name or name != name.strip():
        raise AccountingError(
            f"an accountant name must be a non-empty string without surrounding blanks, got {name!r}."
        )
    if not callable(epsilon_fn):
        raise AccountingError(
            f"epsilon_fn for accountant {name!r} must be callable (history, delta) -> ε, got {epsilon_fn!r}."
        )
    if name in _REGISTRY and not replace:
        raise AccountingError(f"an accountant named {name!r} is already registered (pass replace=True to replace it).")
    spec = AccountantSpec(
        name,
        epsilon_fn,
        composes_history=bool(composes_history),
        upper_bound=bool(upper_bound),
        requires=requires,
        install=install,
        description=description,
        caveat=caveat,
    )
    _REGISTRY[name] = spec
    return spec


def accountant_spec(name) -> AccountantSpec:
    """The :class:`AccountantSpec` registered under ``name`` (an :class:`~dpzoo.errors.AccountingError` if none)."""
    return _REGISTRY[_check_name(name)]


def _check_name(name) -> str:
    if not isinstance(name, str) or name not in _REGISTRY:
        raise AccountingError(
            f"accountant={name!r} is unknown: choose one of {', '.join(map(repr, ACCOUNTANTS))} "
            "(or register one with dpzoo.register_accountant)."
        )
    return name


def _number(value, arg: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        try:  # 0-d tensors and arrays
            value = value.item()
        except (AttributeError, ValueError, TypeError):
            raise AccountingError(f"{arg} must be a real number, got {value!r}.") from None
    return float(value)


def _entry(noise_multiplier, sample_rate, steps) -> list:
    """A validated [σ, q, steps] history entry."""
    sigma = _number(noise_multiplier, "noise_multiplier")
    if not (math.isfinite(sigma) and sigma >= 0):
        raise AccountingError(f"noise_multiplier must be a finite number >= 0 (0 = no noise, ε = ∞), got {sigma}.")
    q = _number(sample_rate, "sample_rate")
    if not 0 < q <= 1:
        raise AccountingError(f"sample_rate must be in (0, 1] (batch size / dataset size), got {q}.")
    n = _number(steps, "steps")
    if not (math.isfinite(n) and n >= 0 and n == int(n)):
        raise AccountingError(f"steps must be a whole number >= 0, got {steps!r}.")
    return [sigma, q, int(n)]


def _row(h) -> list:
    try:
        sigma, q, steps = h
    except (TypeError, ValueError):
        raise AccountingError(f"a history entry must be (noise_multiplier, sample_rate, steps), got {h!r}.") from None
    return _entry(sigma, q, steps)


def _check_delta(delta, arg: str = "delta") -> float:
    d = _number(delta, arg)
    if not 0 < d < 1:
        raise AccountingError(f"{arg} must be in (0, 1) (typically < 1 / dataset size), got {delta!r}.")
    return d


def _spent(history: list) -> list:
    return [h for h in history if h[2] > 0]


def _label(name: str) -> str:
    spec = _REGISTRY.get(name)
    return f"accountant={name!r}" + (f" ({spec.description})" if spec is not None and spec.description else "")


def _composes(name: str) -> bool:
    spec = _REGISTRY.get(name)
    return spec is None or spec.composes_history


def _check_single(name: str, history: list) -> None:
    """An accountant that does not compose (``"gdp"``: Opacus reads ``history[-1]`` only): refuse
    a history with more than one (σ, q), which it would under-report."""
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

    def __init__(self, name: str = "rdp", history: Iterable = ()):
        spec = accountant_spec(name)
        if spec.requires:
            try:
                importlib.import_module(spec.requires)
            except ImportError:
                raise ImportError(
                    f"The {name!r} accountant comes from {spec.install or spec.requires}, "
                    "or use accountant='pld' / 'rdp' (dp-accounting)."
                ) from None
        self.name = name
        self.history: list[list] = [_row(h) for h in history]
        _check_single(name, self.history)

    def check(self, noise_multiplier: float, sample_rate: float) -> None:
        """Raise :class:`~dpzoo.errors.AccountingError` if steps of (σ, q) could not be recorded
        (bad values, or an accountant that does not compose, such as ``"gdp"``, with another (σ, q)
        in the history); records nothing. For set-up
        code that wants the refusal before the first step."""
        entry = _entry(noise_multiplier, sample_rate, 1)
        _check_single(self.name, self.history + [entry])

    def step(self, noise_multiplier: float, sample_rate: float, steps: int = 1) -> None:
        """Record ``steps`` steps of the Poisson-subsampled Gaussian mechanism (σ, q).

        With an accountant that does not compose (``"gdp"``), a (σ, q) other than the history's is
        refused here, before it is recorded (dpzoo's optimizer records a step before applying it)."""
        entry = _entry(noise_multiplier, sample_rate, steps)
        if entry[2] > 0:
            _check_single(self.name, self.history + [entry])
        if self.history and self.history[-1][0] == entry[0] and self.history[-1][1] == entry[1]:
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
        return {"name": self.name, "history": [list(h) for h in self.history]}

    def load_state_dict(self, state: dict) -> None:
        if state.get("name") != self.name:
            raise AccountingError(
                f"checkpoint accountant {state.get('name')!r} != this engine's {self.name!r}: "
                f"create the engine with accountant={state.get('name')!r}."
            )
        history = [_row(h) for h in state["history"]]
        _check_single(self.name, history)
        self.history = history


def _epsilon(name: str, history: list, delta: float) -> float:
    import logging

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


# -- built-in accountants: registered like any other ---------------------------------------------


def _dp_accounting_epsilon(kind: str) -> Callable[[list, float], float]:
    def epsilon(history: list, delta: float) -> float:
        from dp_accounting import dp_event

        if kind == "pld":
            from dp_accounting.pld.pld_privacy_accountant import PLDAccountant as Impl
        else:
            from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant as Impl
        acc = Impl()
        for sigma, q, steps in history:
            event = dp_event.GaussianDpEvent(sigma)
            if q < 1:
                event = dp_event.PoissonSampledDpEvent(q, event)
            acc.compose(event, steps)
        return float(acc.get_epsilon(delta))

    epsilon.__qualname__ = f"dp_accounting_{kind}_epsilon"
    return epsilon


def _opacus_epsilon(kind: str) -> Callable[[list, float], float]:
    def epsilon(history: list, delta: float) -> float:
        from opacus.accountants import create_accountant

        acc = create_accountant(kind)
        acc.history = [tuple(h) for h in history]
        return float(acc.get_epsilon(delta))

    epsilon.__qualname__ = f"opacus_{kind}_epsilon"
    return epsilon


_OPACUS_INSTALL = "Opacus: pip install 'dpzoo[opacus]'"
register_accountant("pld", _dp_accounting_epsilon("pld"), description="dp-accounting's PLDAccountant")
register_accountant("rdp", _dp_accounting_epsilon("rdp"), description="dp-accounting's RdpAccountant")
register_accountant(
    "prv",
    _opacus_epsilon("prv"),
    requires="opacus.accountants",
    install=_OPACUS_INSTALL,
    description="Opacus' PRVAccountant",
)
register_accountant(
    "gdp",
    _opacus_epsilon("gdp"),
    composes_history=False,
    upper_bound=False,
    requires="opacus.accountants",
    install=_OPACUS_INSTALL,
    description="Opacus' GaussianAccountant",
    caveat="Opacus' Gaussian-DP accountant is a central-limit approximation, not an upper bound "
    "(σ = 1, q = 0.1, 5 steps, δ = 1e-5: it reports ε = 1.10 where PLD's bound is 2.35)",
)
register_accountant(
    "opacus-rdp",
    _opacus_epsilon("rdp"),
    requires="opacus.accountants",
    install=_OPACUS_INSTALL,
    description="Opacus' RDPAccountant",
)


def get_noise_multiplier(
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "rdp",
    tolerance: float = 0.01,
    history: Iterable = (),
) -> float:
    """The smallest σ (to ``tolerance`` in ε) whose ε after ``steps`` steps is ≤ ``target_epsilon``.

    A bracket on σ, then a safeguarded regula falsi, with every ε computed by the chosen library
    accountant: the returned σ is one whose ε *that* accountant has checked to be ≤
    ``target_epsilon`` (RDP serves only as a first guess, and only without a history).
    ``history`` ((σ, q, steps) triples) is what has already been spent, e.g. DP-FROST's parameter
    selection: the new mechanism is composed after it (DP-FROST App. C, Algorithm 2). An accountant
    that cannot compose (``"gdp"``) refuses a non-empty history.
    """
    _check_name(accountant)
    eps_target = _number(target_epsilon, "target_epsilon")
    if not (math.isfinite(eps_target) and eps_target > 0):
        raise AccountingError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}.")
    target_delta = _check_delta(target_delta, "target_delta")
    tol = _number(tolerance, "tolerance")
    if not (math.isfinite(tol) and tol > 0):
        raise AccountingError(f"tolerance (in ε) must be a finite number > 0, got {tolerance!r}.")
    new = _entry(1.0, sample_rate, steps)
    if new[2] < 1:
        raise AccountingError(f"steps must be a whole number >= 1 (the steps to calibrate σ for), got {steps!r}.")
    sample_rate, steps = new[1], new[2]
    base = Accountant(accountant, history)
    history = base.history
    if _spent(history):
        if not _composes(accountant):
            raise AccountingError(
                f"{_label(accountant)} cannot calibrate σ after a spent "
                f"history (it only counts the last (σ, q)): {_MULTI}."
            )
        spent = base.get_epsilon(target_delta)
        if spent >= eps_target:
            raise AccountingError(
                f"the history already spends ε = {spent:.3g} >= target_epsilon = {eps_target} "
                f"at δ = {target_delta}: nothing is left for {steps} more steps."
            )

    cache: dict[float, float] = {0.0: math.inf}

    def eps(sigma: float) -> float:
        if sigma not in cache:
            a = Accountant(accountant, history)
            a.step(sigma, sample_rate, steps)
            cache[sigma] = a.get_epsilon(target_delta)
        return cache[sigma]

    lo, hi = 0.0, 1.0
    if not _spent(history) and accountant not in ("rdp", "opacus-rdp"):
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
    # Safeguarded regula falsi on log ε(log σ) (about linear), aiming at target - tol/2, with a
    # bisection step whenever an interpolation did not halve the bracket.
    # Invariant: eps(hi) <= target < eps(lo); only a σ whose ε was checked is returned.
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
