"""Accounting never under-reports ε (issue 13, item 7).

Every ε comes from a library: dp-accounting ("rdp", "pld") or Opacus ("prv", "opacus-rdp",
"gdp"). These tests check that dpzoo hands the *whole* history to the library, refuses the one
accountant that cannot compose ("gdp"), calibrates σ after a spent history with the accountant
asked for, and refuses bad arguments with a :class:`dpzoo.DPZooError` instead of a wrong ε.
Each test says what the code before this change did.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpzoo
from dpzoo import frost
from dpzoo.errors import AccountingError
from dpzoo.privacy.accounting import accountant as A
from dpzoo.privacy.accounting.accountant import Accountant, get_noise_multiplier

opacus = pytest.importorskip("opacus")

DELTA = 1e-5
# (σ, q, steps): two different mechanisms, e.g. DP-FROST's selection and the DP-SGD after it
FIRST, SECOND = (1.0, 0.1, 5), (1.3, 0.05, 30)


@pytest.fixture(autouse=True)
def _quiet_gdp():
    with warnings.catch_warnings():  # Opacus warns on every GaussianAccountant it creates
        warnings.filterwarnings("ignore", message="GDP accounting is experimental")
        yield


def _dp_accounting_epsilon(name, entries):
    """dp-accounting composing the events itself."""
    from dp_accounting import dp_event
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
    from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant

    acc = PLDAccountant() if name == "pld" else RdpAccountant()
    for sigma, q, steps in entries:
        acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
    return acc.get_epsilon(DELTA)


def _opacus_epsilon(name, entries):
    """Opacus recording the steps one by one through its own ``step`` (its history)."""
    from opacus.accountants import create_accountant

    acc = create_accountant({"prv": "prv", "opacus-rdp": "rdp", "gdp": "gdp"}[name])
    for sigma, q, steps in entries:
        for _ in range(steps):
            acc.step(noise_multiplier=sigma, sample_rate=q)
    return acc.get_epsilon(DELTA)


def _library_epsilon(name, entries):
    return (_dp_accounting_epsilon if name in ("pld", "rdp") else _opacus_epsilon)(name, entries)


# -- 1. every accountant composes the whole history (or refuses) ------------------------------


@pytest.mark.parametrize("name", ["pld", "rdp", "prv", "opacus-rdp"])
def test_two_entry_history_is_what_the_library_composes(name):
    """Passed before as well (the composing accountants were fed the whole history); it pins
    that down, and that the 2-entry ε exceeds each entry's alone."""
    acc = Accountant(name)
    acc.step(*FIRST)
    acc.step(*SECOND)
    assert acc.history == [list(FIRST), list(SECOND)]
    both = acc.get_epsilon(DELTA)
    assert both == pytest.approx(_library_epsilon(name, [FIRST, SECOND]), rel=1e-9)
    alone = [Accountant(name, [e]).get_epsilon(DELTA) for e in (FIRST, SECOND)]
    assert alone == pytest.approx([_library_epsilon(name, [e]) for e in (FIRST, SECOND)], rel=1e-9)
    assert both > max(alone)


def test_gdp_refuses_a_second_mechanism_when_it_is_recorded():
    """Before: Accountant("gdp") recorded (1.0, 0.1, 5) then (1.3, 0.05, 30) and reported ε of the
    last entry only (0.91 here, while PLD composes both to 2.53, PRV to 2.54)."""
    acc = Accountant("gdp")
    acc.step(*FIRST)
    with pytest.raises(AccountingError, match="'pld' or 'rdp'.*'prv'"):
        acc.step(*SECOND)
    assert acc.history == [list(FIRST)]  # the refused step is not recorded
    with pytest.raises(AccountingError, match="gdp"):
        acc.check(SECOND[0], SECOND[1])  # the same refusal for set-up code, recording nothing
    acc.check(FIRST[0], FIRST[1])
    acc.step(*FIRST)  # the same mechanism again is fine
    assert acc.history == [[1.0, 0.1, 10]]
    assert acc.get_epsilon(DELTA) == pytest.approx(_opacus_epsilon("gdp", [(1.0, 0.1, 10)]), rel=1e-9)
    assert isinstance(AccountingError("x"), dpzoo.DPZooError)


def test_gdp_refuses_a_multi_entry_history_everywhere():
    """Before: each of these returned the ε (or σ) of the last entry alone."""
    two = [list(FIRST), list(SECOND)]
    with pytest.raises(AccountingError, match="gdp"):
        Accountant("gdp", two)
    acc = Accountant("gdp")
    acc.history = [list(h) for h in two]  # e.g. set by hand
    with pytest.raises(AccountingError, match="gdp"):
        acc.get_epsilon(DELTA)
    with pytest.raises(AccountingError, match="gdp"):
        Accountant("gdp").load_state_dict({"name": "gdp", "history": two})
    with pytest.raises(AccountingError, match="gdp"):  # the calibrated σ would be a second entry
        get_noise_multiplier(3.0, DELTA, 0.1, 20, "gdp", history=[FIRST])
    with pytest.raises(AccountingError, match="gdp"):
        frost.compute_sigma(3.0, DELTA, 0.1, 20, 0.1, 5, accountant="gdp")
    # one (σ, q) split over several entries (or around a 0-step entry) is one mechanism
    split = Accountant("gdp", [[1.0, 0.1, 4], [1.3, 0.05, 0], [1.0, 0.1, 6]])
    assert split.get_epsilon(DELTA) == pytest.approx(_opacus_epsilon("gdp", [(1.0, 0.1, 10)]), rel=1e-9)


def test_gdp_is_refused_for_training():
    """A gdp accountant under-reports (CLT approximation; with a history it reads the last entry
    only): the engine refuses it before anything trains. Before: training ran and get_epsilon
    reported the training's ε only."""
    for acc in ("gdp", Accountant("gdp", [[2.0, 0.1, 5]])):
        with pytest.raises(dpzoo.DPZooError, match="gdp"):
            dpzoo.PrivacyEngine(accountant=acc)


# -- 2. calibration after a spent history uses the accountant asked for -----------------------


@pytest.mark.parametrize("name", ["pld", "prv"])
def test_calibration_after_a_history_uses_the_same_accountant(name):
    """DP-FROST's ComputeSigma: σ_ps after σ_SGD spent 0.9 · ε. Before: the σ bracket came from
    RDP, which finds the history alone already over budget (ε_RDP = 3.26 > 3) and raised
    "already spends", although PLD / PRV leave 0.3 of ε for the selection."""
    eps, delta, q, steps = 3.0, 1e-4, 0.1, 5
    sgd = get_noise_multiplier(0.9 * eps, delta, 0.1, 20, name)
    history = [[sgd, 0.1, 20]]
    assert Accountant("rdp", history).get_epsilon(delta) > eps  # the case RDP cannot bracket
    sigma = get_noise_multiplier(eps, delta, q, steps, name, history=history)
    composed = Accountant(name, [[sigma, q, steps]] + history).get_epsilon(delta)  # selection first
    assert eps - 0.02 <= composed <= eps
    acc = Accountant(name, history)
    acc.step(sigma, q, steps)
    assert eps - 0.01 <= acc.get_epsilon(delta) <= eps  # the order it was calibrated in: to tolerance


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.classifier = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.classifier(torch.relu(self.b(torch.relu(self.a(x)))))


def test_frost_select_with_prv_meets_the_target():
    """Before: frost.select(..., accountant="prv") raised "already spends" (RDP's bracket) at the
    default budget_ratio."""
    torch.manual_seed(0)
    ds = TensorDataset(torch.randn(300, 4), torch.randint(0, 3, (300,)))
    eps, delta = 3.0, 1e-4
    sel = frost.select(
        _Tiny(),
        DataLoader(ds, batch_size=30),
        eps,
        delta,
        ratio=0.5,
        epochs=2,
        sample_rate=0.1,
        accountant="prv",
        seed=0,
        pgm_iterations=50,
    )
    assert sel.accountant.name == "prv" and sel.accountant.history == [[sel.selection_noise_multiplier, 0.1, 5]]
    sel.accountant.step(sel.noise_multiplier, sel.sgd_sample_rate, sel.sgd_steps)  # what training records
    assert eps - 0.02 <= sel.accountant.get_epsilon(delta) <= eps


# -- 3. bad arguments are DPZooErrors naming the argument ---------------------------------------


@pytest.mark.parametrize(
    "call, arg",
    [
        (lambda: get_noise_multiplier(0, DELTA, 0.1, 10), "target_epsilon"),
        (lambda: get_noise_multiplier(-1, DELTA, 0.1, 10), "target_epsilon"),
        (lambda: get_noise_multiplier(math.inf, DELTA, 0.1, 10), "target_epsilon"),
        (lambda: get_noise_multiplier(math.nan, DELTA, 0.1, 10), "target_epsilon"),
        (lambda: get_noise_multiplier(3, 0, 0.1, 10), "target_delta"),
        (lambda: get_noise_multiplier(3, 1, 0.1, 10), "target_delta"),
        (lambda: get_noise_multiplier(3, DELTA, 0, 10), "sample_rate"),
        (lambda: get_noise_multiplier(3, DELTA, 1.5, 10), "sample_rate"),
        (lambda: get_noise_multiplier(3, DELTA, 0.1, 0), "steps"),
        (lambda: get_noise_multiplier(3, DELTA, 0.1, 2.5), "steps"),
        (lambda: get_noise_multiplier(3, DELTA, 0.1, 10, "moments"), "accountant"),
        (lambda: get_noise_multiplier(3, DELTA, 0.1, 10, tolerance=0), "tolerance"),
        (lambda: Accountant("moments"), "accountant"),
        (lambda: Accountant().step(-1.0, 0.1), "noise_multiplier"),
        (lambda: Accountant().step(math.nan, 0.1), "noise_multiplier"),
        (lambda: Accountant().step(1.0, 0.0), "sample_rate"),
        (lambda: Accountant().step(1.0, 0.1, -1), "steps"),
        (lambda: Accountant().get_epsilon(0), "delta"),
        (lambda: Accountant().get_epsilon(1.0), "delta"),
    ],
)
def test_bad_arguments_are_accounting_errors(call, arg):
    """Before: a plain ValueError (not a DPZooError) with one message for all four arguments;
    target_epsilon = nan or inf returned σ ≈ 1e-6 (no noise)."""
    with pytest.raises(AccountingError, match=arg) as info:
        call()
    assert isinstance(info.value, dpzoo.DPZooError) and isinstance(info.value, ValueError)


# -- 4. ε is never silently 0, too small or nan ---------------------------------------------------


@pytest.mark.parametrize(
    "entry, arg",
    [
        ([-1.0, 0.1, 5], "noise_multiplier"),
        ([math.inf, 0.1, 5], "noise_multiplier"),
        ([1.0, 0.0, 5], "sample_rate"),
        ([1.0, 0.1, 2.5], "steps"),
    ],
)
@pytest.mark.parametrize("name", ["rdp", "pld", "opacus-rdp"])
def test_a_bad_history_entry_is_refused(name, entry, arg):
    """Histories come from users and checkpoints too. Before: q = 0 gave ε = 0 ("rdp", "pld");
    σ = ∞ gave ε = 0 ("rdp") or hung ("opacus-rdp", "prv"); 2.5 steps gave an ε ("opacus-rdp");
    σ < 0 raised a library ValueError."""
    with pytest.raises(AccountingError, match=arg):
        Accountant(name, [entry])
    with pytest.raises(AccountingError, match=arg):
        Accountant(name).load_state_dict({"name": name, "history": [entry]})


@pytest.mark.parametrize("name", ["pld", "rdp", "prv", "opacus-rdp", "gdp"])
def test_no_noise_is_infinite_epsilon(name):
    """Passed before as well; pins it down for every accountant (also after a second entry)."""
    assert Accountant(name).get_epsilon(DELTA) == 0.0  # nothing released yet
    acc = Accountant(name, [[0.0, 0.1, 5]])
    assert acc.get_epsilon(DELTA) == math.inf
    if name != "gdp":
        acc.step(*SECOND)
        assert acc.get_epsilon(DELTA) == math.inf


def test_a_nan_from_the_library_is_refused():
    """Before: get_epsilon passed the library's nan on (every ε ≤ target comparison is then False)."""
    A.register_accountant("test-nan", lambda history, delta: math.nan)
    try:
        with pytest.raises(AccountingError, match="nan"):
            Accountant("test-nan", [list(FIRST)]).get_epsilon(DELTA)
    finally:
        A.unregister_accountant("test-nan")
