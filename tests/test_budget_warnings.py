"""Budgets that say little are said (issue 28 item 1): no noise, a target ε ≥ 100, training past
the steps σ was calibrated for; and a saved privacy record is validated when loaded, as when saved."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpzoo
from dpzoo.errors import SaveError, WeakPrivacyWarning


def _private(**kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    data = TensorDataset(torch.randn(200, 4), torch.randint(0, 3, (200,)))
    engine = dpzoo.PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(data, batch_size=50),
        max_grad_norm=1.0, **kw,
    )  # fmt: skip
    return engine, model, opt, loader


def _steps(model, opt, loader, n):
    it = iter(loader)
    for _ in range(n):
        x, y = next(it)
        if len(y):
            F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def test_no_noise_warns_that_epsilon_is_infinite():
    with pytest.warns(WeakPrivacyWarning, match=r"noise_multiplier = 0.*ε = ∞"):
        _private(noise_multiplier=0.0)


def test_a_target_epsilon_of_100_or_more_warns():
    with pytest.warns(WeakPrivacyWarning, match="target_epsilon = 150"):
        _private(target_epsilon=150.0, target_delta=1e-3, epochs=1)


def test_an_ordinary_budget_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", WeakPrivacyWarning)
        engine, model, opt, loader = _private(target_epsilon=4.0, target_delta=1e-3, epochs=1)
        _steps(model, opt, loader, engine.planned_steps)
    assert engine.steps == engine.planned_steps == 4


def test_training_past_the_calibrated_steps_warns_once_with_the_step():
    engine, model, opt, loader = _private(target_epsilon=4.0, target_delta=1e-3, epochs=1)
    _steps(model, opt, loader, engine.planned_steps)
    with pytest.warns(WeakPrivacyWarning, match=r"step 5 is past the 4 steps") as caught:
        _steps(model, opt, loader, 3)
    assert sum(issubclass(w.category, WeakPrivacyWarning) for w in caught) == 1
    assert engine.get_epsilon(1e-3) > 4.0


def test_load_refuses_a_hand_edited_privacy_record(tmp_path):
    """A record dpzoo.save would refuse ("epsilon": "three") is refused by dpzoo.load too (before:
    loaded silently, and a later run composed nothing)."""
    model = dpzoo.load("resnet18-gn-bias", num_classes=3, layers=[1, 1, 1, 1], width=4)
    privacy = {"epsilon": 3.0, "delta": 1e-5, "accountant": "rdp", "steps": 10, "sample_rate": 0.01}
    out = dpzoo.save(model, tmp_path / "m", privacy=privacy)
    assert dpzoo.load(out).dpzoo_privacy["epsilon"] == 3.0
    config = out / "dpzoo_config.json"
    record = json.loads(config.read_text())
    record["privacy"]["epsilon"] = "three"
    config.write_text(json.dumps(record))
    with pytest.raises(SaveError, match="privacy record is invalid.*epsilon"):
        dpzoo.load(out)
