"""A private run on a small real dataset (scikit-learn's digits) learns at ε ≈ 8."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpzoo

sklearn = pytest.importorskip("sklearn", reason="scikit-learn (test extra) ships the digits dataset")


def test_private_training_on_digits_learns_at_epsilon_8():
    from sklearn.datasets import load_digits

    torch.manual_seed(0)
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16
    y = torch.tensor(d.target)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = perm[:360], perm[360:]
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    engine = dpzoo.PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(TensorDataset(x[train], y[train]), batch_size=64),
        target_epsilon=8.0,
        target_delta=1e-5,
        epochs=10,
        max_grad_norm=1.0,
        sample_seed=0,
        noise_seed=0,
    )
    for _ in range(10):
        for xb, yb in loader:
            if xb.shape[0]:
                F.cross_entropy(model(xb), yb).backward()
            opt.step()
            opt.zero_grad()
    with torch.no_grad():
        acc = (model(x[test]).argmax(1) == y[test]).float().mean().item()
    eps = engine.get_epsilon(1e-5)
    print(f"digits, private MLP: accuracy {acc:.3f} at epsilon {eps:.2f} (sigma {engine.noise_multiplier:.3f})")
    assert 7.5 <= eps <= 8.0
    assert acc > 0.7  # chance is 0.1
