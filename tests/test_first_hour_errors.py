"""Mistakes a newcomer makes in the first hour get one line saying what to do (issue 28 item 5):
Opacus' secure_mode, the accountant passed to make_private, making a private model private
again, an IterableDataset, a model on the meta device."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import dpzoo
from dpzoo.errors import PrivacyUsageError, UnsupportedModuleError


def _parts(model=None):
    model = model if model is not None else nn.Linear(4, 2)
    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=4)


def _private(engine, model, opt, loader):
    return engine.make_private(module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0)


def _one_line(e) -> str:
    text = str(e.value)
    assert "\n" not in text
    return text


def test_opacus_secure_mode_is_answered():
    with pytest.raises(PrivacyUsageError, match="secure_mode is Opacus' option.*OS entropy") as e:
        dpzoo.PrivacyEngine(secure_mode=True)
    _one_line(e)


def test_the_accountant_belongs_to_the_engine():
    with pytest.raises(
        PrivacyUsageError, match=r"accountant belongs to the engine.*PrivacyEngine\(accountant='pld'\)"
    ) as e:
        dpzoo.PrivacyEngine().make_private(*(), **dict(zip(("module", "optimizer", "data_loader"), _parts())),
                                           noise_multiplier=1.0, accountant="pld")  # fmt: skip
    _one_line(e)


def test_making_a_private_model_private_again_says_how():
    engine = dpzoo.PrivacyEngine()
    model, opt, plain_loader = _parts()
    model, opt, loader = _private(engine, model, opt, plain_loader)
    with pytest.raises(UnsupportedModuleError, match=r"engine\.detach\(\).*attached_norm_hooks") as e:
        _private(dpzoo.PrivacyEngine(), model, torch.optim.SGD(model.parameters(), lr=0.1), plain_loader)
    _one_line(e)
    engine.detach()  # what the message says works
    _private(dpzoo.PrivacyEngine(), model, torch.optim.SGD(model.parameters(), lr=0.1), plain_loader)


def test_an_iterable_dataset_is_refused_with_the_reason():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter([(torch.randn(4), 0)] * 8)

    model, opt, _ = _parts()
    with pytest.raises(PrivacyUsageError, match="map-style dataset") as e:
        _private(dpzoo.PrivacyEngine(), model, opt, DataLoader(Stream(), batch_size=4))
    _one_line(e)


def test_a_model_on_the_meta_device_is_refused():
    model, opt, loader = _parts(nn.Linear(4, 2, device="meta"))
    with pytest.raises(PrivacyUsageError, match="meta device.*to_empty") as e:
        _private(dpzoo.PrivacyEngine(), model, opt, loader)
    _one_line(e)


@pytest.mark.parametrize("key", ["torch_dtype", "dtype"])
def test_load_with_a_dtype_says_to_cast_after_loading(key):
    """transformers' habit: was 'cannot be recorded for dpzoo.save', which says nothing useful."""
    with pytest.raises(dpzoo.errors.OverrideError, match=rf"takes no {key}=; cast after loading") as info:
        dpzoo.load("resnet18-gn-bias", width=8, **{key: torch.bfloat16})
    assert "\n" not in str(info.value)
