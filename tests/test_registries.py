"""Registries for what users extend (issue 14, item 3): accountants, datasets, training modes;
the command line takes its choices from them."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpzoo
from dpzoo.cli import build_parser
from dpzoo.errors import AccountingError, DPZooError, PrivacyUsageError
from dpzoo.privacy import engine as E
from dpzoo.privacy import modes as M
from dpzoo.privacy.accounting import accountant as A
from dpzoo.privacy.accounting.accountant import ACCOUNTANTS, Accountant, get_noise_multiplier
from dpzoo.seqrec import DatasetSpec, load_dataset, register_dataset
from dpzoo.seqrec import downloads as D

DELTA = 1e-5


@pytest.fixture
def registered():
    """Names registered by a test are removed afterwards (accountants and datasets)."""
    before_acc, before_data = {n: A.accountant_spec(n) for n in ACCOUNTANTS}, dict(D.DATASETS)
    yield
    for name in [n for n in ACCOUNTANTS if n not in before_acc]:
        A.unregister_accountant(name)
    for spec in before_acc.values():  # a replaced one (replace=True) back as it was, in its place
        if spec.name not in ACCOUNTANTS or A.accountant_spec(spec.name) is not spec:
            A.register_accountant(
                spec.name,
                spec.epsilon,
                composes_history=spec.composes_history,
                requires=spec.requires,
                upper_bound=spec.upper_bound,
                install=spec.install,
                description=spec.description,
                caveat=spec.caveat,
                replace=True,
            )
    D.DATASETS.clear()
    D.DATASETS.update(before_data)


def _pld_wrapper(history, delta):
    """dp-accounting's PLD, composing the history itself: what a user would register."""
    from dp_accounting import dp_event
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

    acc = PLDAccountant()
    for sigma, q, steps in history:
        acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
    return acc.get_epsilon(delta)


def _train_parser():
    return build_parser()._subparsers._group_actions[0].choices["train"]


def _train_args(*extra):
    return build_parser().parse_args(["train", "resnet18-gn-bias", *extra])


# -- accountants --------------------------------------------------------------------------------


def test_builtins_are_registered_in_order():
    assert tuple(ACCOUNTANTS) == ("pld", "rdp", "prv", "gdp", "opacus-rdp")
    assert ACCOUNTANTS == ("pld", "rdp", "prv", "gdp", "opacus-rdp") and ACCOUNTANTS[0] == "pld"
    assert "rdp" in ACCOUNTANTS and "moments" not in ACCOUNTANTS and 3 not in ACCOUNTANTS
    gdp = A.accountant_spec("gdp")
    assert not gdp.upper_bound and not gdp.composes_history and gdp.requires == "opacus.accountants"
    assert all(
        A.accountant_spec(n).upper_bound and A.accountant_spec(n).composes_history
        for n in ("pld", "rdp", "prv", "opacus-rdp")
    )
    assert dpzoo.register_accountant is A.register_accountant is dpzoo.privacy.register_accountant


def test_a_registered_accountant_works_in_the_engine_and_the_cli(registered):
    spec = dpzoo.register_accountant("my-pld", _pld_wrapper, description="PLD, wrapped by a test")
    assert spec.name == "my-pld" and "my-pld" in ACCOUNTANTS  # ACCOUNTANTS is a view of the registry
    history = [[1.0, 0.1, 5], [1.3, 0.05, 30]]
    assert Accountant("my-pld", history).get_epsilon(DELTA) == pytest.approx(
        Accountant("pld", history).get_epsilon(DELTA), rel=1e-12
    )
    sigma = get_noise_multiplier(3.0, DELTA, 0.1, 20, "my-pld")
    assert sigma == pytest.approx(get_noise_multiplier(3.0, DELTA, 0.1, 20, "pld"), rel=1e-9)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    data = TensorDataset(torch.randn(100, 4), torch.randint(0, 3, (100,)))
    engine = dpzoo.PrivacyEngine(accountant="my-pld")
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=10),
        target_epsilon=2.0,
        target_delta=DELTA,
        epochs=1,
    )
    for x, y in loader:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert engine.accountant.name == "my-pld" and engine.steps == 10
    assert 1.9 <= engine.get_epsilon(DELTA) <= 2.0
    assert engine.privacy_metadata(DELTA)["accountant"] == "my-pld"

    assert _train_args("--accountant", "my-pld").accountant == "my-pld"  # offered by `dpzoo train`
    assert build_parser().parse_args(["audit", "--accountant", "my-pld"]).accountant == "my-pld"


def test_registration_is_checked(registered):
    with pytest.raises(AccountingError, match="already registered"):
        dpzoo.register_accountant("pld", _pld_wrapper)
    with pytest.raises(AccountingError, match="callable"):
        dpzoo.register_accountant("not-a-function", 3.0)
    with pytest.raises(AccountingError, match="name"):
        dpzoo.register_accountant("", _pld_wrapper)
    with pytest.raises(AccountingError, match="unknown.*register"):
        Accountant("my-pld")
    dpzoo.register_accountant("my-pld", _pld_wrapper)
    dpzoo.register_accountant("my-pld", lambda h, d: 1.0, replace=True)
    assert Accountant("my-pld", [[1.0, 0.1, 5]]).get_epsilon(DELTA) == 1.0


def test_an_accountant_that_is_not_an_upper_bound_is_refused_for_training(registered):
    dpzoo.register_accountant(
        "approx", lambda h, d: 0.5 * _pld_wrapper(h, d), upper_bound=False, caveat="it halves PLD's ε"
    )
    acc = Accountant("approx", [[1.0, 0.1, 5]])  # kept for comparisons
    assert acc.get_epsilon(DELTA) == pytest.approx(0.5 * Accountant("pld", [[1.0, 0.1, 5]]).get_epsilon(DELTA))
    for a in ("approx", acc):
        with pytest.raises(PrivacyUsageError, match="'approx' is refused for training: it halves PLD's ε"):
            dpzoo.PrivacyEngine(accountant=a)
    with pytest.raises(SystemExit):  # not offered by the command line either
        _train_args("--accountant", "approx")
    with pytest.raises(SystemExit):
        _train_args("--accountant", "gdp")


def test_an_accountant_that_does_not_compose_sees_one_entry(registered):
    seen = []

    def last_only(history, delta):
        seen.append(list(history))
        return _pld_wrapper(history, delta)

    dpzoo.register_accountant("single", last_only, composes_history=False, description="a one-mechanism library")
    acc = Accountant("single", [[1.0, 0.1, 4], [1.3, 0.05, 0], [1.0, 0.1, 6]])  # one (σ, q): fine
    acc.get_epsilon(DELTA)
    assert seen == [[(1.0, 0.1, 10)]]
    with pytest.raises(AccountingError, match=r"'single' \(a one-mechanism library\) only counts the last"):
        acc.step(1.3, 0.05)
    with pytest.raises(AccountingError, match="'single'.*cannot calibrate"):
        get_noise_multiplier(3.0, DELTA, 0.1, 20, "single", history=[[1.0, 0.1, 5]])
    assert math.isfinite(get_noise_multiplier(3.0, DELTA, 0.1, 20, "single"))


def test_a_missing_requirement_is_an_import_error(registered):
    dpzoo.register_accountant(
        "needs-lib", _pld_wrapper, requires="dpzoo_no_such_module", install="the no-such package: pip install no-such"
    )
    with pytest.raises(ImportError, match="comes from the no-such package: pip install no-such"):
        Accountant("needs-lib")


# -- datasets -----------------------------------------------------------------------------------


def _write_sasrec(path):
    path.write_text("".join(f"{u} {i}\n" for u in range(1, 5) for i in range(1, 6)))
    return path


def test_a_registered_local_dataset_loads_by_name(registered, tmp_path):
    path = _write_sasrec(tmp_path / "mine.txt")
    spec = register_dataset(DatasetSpec("test-local", files=(str(path),), description="a test's file"))
    assert D.DATASETS["test-local"] is spec and spec.files == (str(path),)
    ds = load_dataset("test-local")
    assert ds.name == "test-local" and ds.num_users == 4 and ds.summary()["interactions"] == 20
    # dpzoo train lists it (its --data help comes from the registry)
    help_text = " ".join(_train_parser().format_help().split())
    assert "test-local (a test's file)" in help_text and "ml-1m" in help_text


def test_a_registered_dataset_under_a_data_root_with_its_own_parser(registered, tmp_path, monkeypatch):
    (tmp_path / "d").mkdir()
    _write_sasrec(tmp_path / "d" / "x.txt")
    calls = []

    def parser(path, min_count, name):
        calls.append((path, min_count, name))
        return D.dataset_from_file(path, min_count, name)

    register_dataset(DatasetSpec("test-rel", files="d/x.txt", parser=parser, max_len=77))
    monkeypatch.setenv("DPZOO_DATA", str(tmp_path))
    ds = load_dataset("test-rel", min_count=1)
    assert calls == [(tmp_path / "d" / "x.txt", 1, "test-rel")] and ds.num_users == 4
    assert "test-rel: 77" in " ".join(_train_parser().format_help().split())  # --max-len's default


def test_dataset_registration_is_checked(registered, tmp_path, monkeypatch):
    with pytest.raises(DPZooError, match="already registered"):
        register_dataset(DatasetSpec("ml-1m", files=("x",)))
    with pytest.raises(DPZooError, match="DatasetSpec"):
        register_dataset({"name": "dict-style", "local": ["x"]})
    with pytest.raises(DPZooError, match="local files, a url"):
        DatasetSpec("nothing")
    with pytest.raises(DPZooError, match="columns"):
        DatasetSpec("bad-columns", files=("x",), columns="a,b")
    with pytest.raises(DPZooError, match="name"):
        DatasetSpec(" padded", files=("x",))
    with pytest.raises(Exception):  # frozen: a spec changes by registering a new one
        D.DATASETS["ml-1m"].url = "http://elsewhere"
    register_dataset(DatasetSpec("test-absent", files=("absent/r.txt",)))
    monkeypatch.setattr(D, "search_roots", lambda c: [tmp_path])
    with pytest.raises(DPZooError, match="'test-absent' not found: it has no download.*absent/r.txt"):
        load_dataset("test-absent")


# -- training modes -----------------------------------------------------------------------------


def test_the_modes_table_drives_the_engine_and_the_cli():
    assert E.MODES is M.MODES and dpzoo.privacy.MODES is M.MODES
    assert M.MODES == {name: m.hooks for name, m in M.TRAINING_MODES.items()}
    assert M.MODES == {
        "auto": "auto",
        "bk-mixopt": "auto",
        "bk": "ghost",
        "instantiate": "instantiate",
        "bitfit": "auto",
        "lora": "auto",
    }
    assert [n for n, m in M.TRAINING_MODES.items() if m.bias_only] == ["bitfit"]
    mode = next(a for a in _train_parser()._actions if a.dest == "mode")
    assert list(mode.choices) == list(M.TRAINING_MODES) and mode.default == M.DEFAULT_CLI_MODE
    for name in M.TRAINING_MODES:
        assert _train_args("--mode", name).mode == name
    with pytest.raises(SystemExit):
        _train_args("--mode", "fast")
