"""The registry of accountants: which names ``Accountant``, the engine and the command line accept.

Accountants are registered (:func:`register_accountant`, the built-ins too, from
:mod:`dpzoo.privacy.accounting.backends`): a name, a function turning a (σ, q, steps) history
into ε at δ through a library, whether it composes a multi-entry history and whether its ε is an
upper bound (the engine refuses one that is not). ``ACCOUNTANTS`` is a live view of the
registered names; :func:`unregister_accountant` removes a user's registration (not a built-in).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

from ...errors import AccountingError
from .backends import dp_accounting_epsilon, opacus_epsilon

__all__ = [
    "ACCOUNTANTS",
    "AccountantSpec",
    "register_accountant",
    "unregister_accountant",
    "accountant_spec",
]


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


def unregister_accountant(name) -> AccountantSpec:
    """Remove the accountant registered under ``name`` with :func:`register_accountant` and
    return its :class:`AccountantSpec` (a plugin's tests clean up with it).

    dpzoo's built-in accountants (``"pld"``, ``"rdp"``, ``"prv"``, ``"gdp"``, ``"opacus-rdp"``)
    cannot be removed, only replaced (``register_accountant(name, ..., replace=True)``); removing
    one, or a name that is not registered, raises :class:`~dpzoo.errors.AccountingError`. An
    :class:`Accountant` created under a removed name raises the same error when asked for ε.
    """
    spec = accountant_spec(name)
    if name in _BUILTIN:
        raise AccountingError(
            f"accountant={name!r} is one of dpzoo's built-in accountants and cannot be unregistered "
            f"(register_accountant({name!r}, ..., replace=True) replaces it)."
        )
    del _REGISTRY[name]
    return spec


def _check_name(name) -> str:
    if not isinstance(name, str) or name not in _REGISTRY:
        raise AccountingError(
            f"accountant={name!r} is unknown: choose one of {', '.join(map(repr, ACCOUNTANTS))} "
            "(or register one with dpzoo.register_accountant)."
        )
    return name


# -- built-in accountants: registered like any other ---------------------------------------------

_OPACUS_INSTALL = "Opacus: pip install 'dpzoo[opacus]'"
register_accountant("pld", dp_accounting_epsilon("pld"), description="dp-accounting's PLDAccountant")
register_accountant("rdp", dp_accounting_epsilon("rdp"), description="dp-accounting's RdpAccountant")
register_accountant(
    "prv",
    opacus_epsilon("prv"),
    requires="opacus.accountants",
    install=_OPACUS_INSTALL,
    description="Opacus' PRVAccountant",
)
register_accountant(
    "gdp",
    opacus_epsilon("gdp"),
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
    opacus_epsilon("rdp"),
    requires="opacus.accountants",
    install=_OPACUS_INSTALL,
    description="Opacus' RDPAccountant",
)
_BUILTIN = frozenset(_REGISTRY)  # what unregister_accountant refuses to remove
