"""A DP step whose backward fails (out of memory, say) must not pin memory: its stored activations
are freed once the model and engine are dropped, and a retry on the same model works and frees them
too. Found on an H100: after one out-of-memory step in a largest-batch search, 78 GB stayed allocated
for the rest of the process (a parameter's gradient hook held the recorder through a cycle that
Python's garbage collector cannot see, the hook being owned by the C++ tensor)."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import dpzoo


class _FailingBackward(torch.autograd.Function):
    """Identity whose backward raises while ``armed``: a stand-in for running out of memory."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if _FailingBackward.armed:
            raise RuntimeError("simulated out of memory")
        return grad


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(12, 16)
        self.b = torch.nn.Linear(16, 5)
        self.hidden: weakref.ref | None = None

    def forward(self, x):
        h = self.a(x)  # a's output: the hooks keep it for the step's ghost differentiation
        self.hidden = weakref.ref(h)
        return self.b(_FailingBackward.apply(torch.tanh(h)))


def _private(mode):
    torch.manual_seed(0)
    x, y = torch.randn(8, 12), torch.randint(0, 5, (8,))
    model = _Net()
    engine = dpzoo.PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model_p, opt, loader = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            mode=mode,
            noise_seed=0,
        )
    return model, model_p, opt, loader, engine


def _failed_step(model, model_p, opt, loader):
    """One good step (the engine checks its plan on the first), then a step whose backward fails."""
    xb, yb = next(iter(loader))
    F.cross_entropy(model_p(xb), yb).backward()
    opt.step()
    opt.zero_grad()
    _FailingBackward.armed = True
    try:
        with pytest.raises(RuntimeError, match="simulated out of memory"):
            F.cross_entropy(model_p(xb), yb).backward()
    finally:
        _FailingBackward.armed = False
    return model.hidden


@pytest.mark.parametrize("mode", ["bk-mixopt", "bk", "instantiate", "bitfit"])
def test_activations_of_a_failed_backward_are_freed_with_the_model(mode):
    model, model_p, opt, loader, engine = _private(mode)
    hidden = _failed_step(model, model_p, opt, loader)
    del model, model_p, opt, loader, engine
    gc.collect()
    assert hidden() is None


@pytest.mark.parametrize("mode", ["bk-mixopt", "instantiate"])
def test_a_retry_after_a_failed_backward_steps_once_and_frees_the_failed_step(mode):
    model, model_p, opt, loader, engine = _private(mode)
    hidden = _failed_step(model, model_p, opt, loader)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    xb, yb = next(iter(loader))
    F.cross_entropy(model_p(xb), yb).backward()
    opt.step()
    opt.zero_grad()
    gc.collect()
    assert engine.steps == 2  # the good step and the retry: the failed step was never charged
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    assert hidden() is None
