"""Every zoo entry pickles (issue 14): ``torch.save(model)`` / ``torch.load(..., weights_only=False)``
round-trip it in its small configuration, and the loaded model computes the same outputs."""

from __future__ import annotations

import importlib
import io
import pickle

import pytest
import torch
from conftest import example_batch, output_tensor
from torch import nn

import dpzoo

ALL = dpzoo.list_models()


def _round_trip(model: nn.Module) -> nn.Module:
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("name", ALL)
def test_save_load_round_trip_computes_the_same(name, small_model):
    torch.manual_seed(0)
    model, card = small_model(name)
    model.eval()
    loaded = _round_trip(model).eval()
    assert type(loaded) is type(model)
    assert loaded.state_dict().keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    args, kwargs = example_batch(card, batch_size=3, seed=2)
    with torch.no_grad():
        assert torch.equal(output_tensor(loaded(*args, **kwargs)), output_tensor(model(*args, **kwargs)))
    # the patch report (what dpzoo did to the model) travels with it
    assert loaded.dpzoo_patch_report.to_dict() == model.dpzoo_patch_report.to_dict()


@pytest.mark.parametrize("name", ALL)
def test_no_class_is_created_at_run_time(name, small_model):
    """Every module's class is importable by its module and qualified name (what pickle looks up)."""
    model, _ = small_model(name)
    for sub_name, m in model.named_modules():
        cls = type(m)
        obj = importlib.import_module(cls.__module__)
        for part in cls.__qualname__.split("."):
            obj = getattr(obj, part)
        assert obj is cls, f"{name}: {sub_name or 'the model'} has a class made at run time: {cls!r}"
    pickle.dumps(model)  # plain pickle too, not only torch.save


@pytest.mark.parametrize("name", ["gpt2", "bert-base"])
def test_per_sample_position_ids_survive_the_round_trip(name, small_model):
    model, card = small_model(name)
    loaded = _round_trip(model).eval()
    assert loaded.dpzoo_patch_report.position_ids_per_sample
    seen = []
    for n, m in loaded.named_modules():
        if isinstance(m, nn.Embedding) and ("position" in n or n.endswith("wpe")):
            m.register_forward_hook(lambda mod, inp, out: seen.append(tuple(inp[0].shape)))
    args, kwargs = example_batch(card, batch_size=3)
    with torch.no_grad():
        loaded(*args, **kwargs)
    assert seen == [(3, card.example_input["seq_len"])]  # one lookup per sample, not a broadcast row


def test_dpformer_reattention_state_round_trips():
    card = dpzoo.model_card("dpformer")
    torch.manual_seed(0)
    model = dpzoo.load("dpformer", **card.test_overrides).eval()
    args, kwargs = example_batch(card, batch_size=4, seed=3)
    ids = kwargs["input_ids"].clamp_min(1)
    model.set_token_frequencies(ids)
    model.set_dp_noise(noise_multiplier=2.0, max_grad_norm=1.0, expected_batch_size=4)
    loaded = _round_trip(model).eval()
    assert float(loaded.reattention.noise_std) == pytest.approx(0.5)
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def test_a_model_made_private_pickles_after_detach_and_keeps_its_spending():
    """torch.save of a whole model after make_private and detach() failed on the weak references to
    the engine and the hooks; they are dropped on pickling (the engine lives in this process only),
    and the reloaded model composes the spending it carries (its spending link)."""
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    engine = dpzoo.PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(torch.randn(32, 4), torch.randint(0, 3, (32,))), batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    for x, y in loader:
        if len(y):
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    engine.detach()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    again = torch.load(buffer, weights_only=False)
    from dpzoo.privacy.engine import engine_of

    assert engine_of(again) is None
    assert again.dpzoo_spending.history == [list(h) for h in engine.accountant.history]
