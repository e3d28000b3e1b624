"""A DP-trained LoRA adapter reloaded through PEFT keeps its budget: PeftModel.from_pretrained
keeps no trace of the directory (and its dpzoo_privacy.json), so an adapter that was trained
before and carries no record is refused until the user composes its record or states the data
are disjoint (recorded in the metadata)."""

from __future__ import annotations

import warnings
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpzoo
from dpzoo.errors import PrivacyUsageError
from dpzoo.integrations.trainer_save import read_privacy_metadata, write_privacy_files

peft = pytest.importorskip("peft")

g = torch.Generator().manual_seed(0)
X, Y = torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _plain_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(fc1=nn.Linear(6, 8), act=nn.ReLU(), fc2=nn.Linear(8, 3)))


def _private(model, steps: int = 0):
    engine = dpzoo.PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5),
        data_loader=DataLoader(TensorDataset(X, Y), batch_size=16),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        mode="lora",
        sample_seed=1,
    )
    for _, (x, y) in zip(range(steps), loader):
        if len(y):
            F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return engine


@pytest.fixture
def saved_adapter(tmp_path):
    """A LoRA adapter (PEFT's default init: lora_B = 0) trained with DP, saved by PEFT with its record."""
    model = peft.get_peft_model(_plain_model(), peft.LoraConfig(r=2, target_modules=["fc1", "fc2"]))
    engine = _private(model, steps=4)
    model.save_pretrained(tmp_path)
    write_privacy_files(model, tmp_path, engine.privacy_metadata(1e-5), zoo_files=False)
    return tmp_path, engine.get_epsilon(1e-5)


def test_a_fresh_adapter_trains_without_a_record():
    model = peft.get_peft_model(_plain_model(), peft.LoraConfig(r=2, target_modules=["fc1", "fc2"]))
    assert _private(model).accountant.history == []


def test_a_reloaded_adapter_without_its_record_is_refused(saved_adapter):
    directory, _ = saved_adapter
    loaded = peft.PeftModel.from_pretrained(_plain_model(), directory, is_trainable=True)
    with pytest.raises(PrivacyUsageError, match="'default' already has trained weights.*read_privacy_metadata"):
        _private(loaded)


def test_its_record_composes(saved_adapter):
    directory, spent = saved_adapter
    loaded = peft.PeftModel.from_pretrained(_plain_model(), directory, is_trainable=True)
    loaded.dpzoo_privacy = read_privacy_metadata(directory)
    engine = _private(loaded)
    assert engine.get_epsilon(1e-5) == pytest.approx(spent, rel=1e-6)  # before any new step: the adapter's spending


def test_disjoint_data_is_a_stated_assumption_in_the_metadata(saved_adapter):
    directory, _ = saved_adapter
    loaded = peft.PeftModel.from_pretrained(_plain_model(), directory, is_trainable=True)
    loaded.dpzoo_privacy = {}
    engine = _private(loaded, steps=1)
    assert engine.accountant.history[0][2] == 1  # a fresh budget: only this run's step
    assert "disjoint" in engine.privacy_metadata(1e-5)["public_statistics"]


def _new_adapter(base: nn.Module):
    return peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["fc1", "fc2"]))


@pytest.mark.parametrize("unload", ["merge_and_unload", "merge_adapter_then_unload"])
def test_a_reloaded_adapter_merged_without_its_record_is_refused(saved_adapter, unload):
    """PEFT's merge puts ΔW into the base layers and drops the adapter: without the watch, a new
    adapter on the merged model trained with a fresh budget."""
    directory, _ = saved_adapter
    loaded = peft.PeftModel.from_pretrained(_plain_model(), directory, is_trainable=True)
    if unload == "merge_and_unload":
        merged = loaded.merge_and_unload()
    else:
        loaded.merge_adapter()
        merged = loaded.unload()
    with pytest.raises(
        PrivacyUsageError,
        match=r"Layer 'base_model\.model\.fc1\.base_layer' has a trained LoRA adapter, 'default', merged",
    ):
        _private(_new_adapter(merged))
    reused = nn.Sequential(merged.fc2)  # one merged layer reused elsewhere carries the mark too
    with pytest.raises(PrivacyUsageError, match="merged into its weights"):
        _private(_new_adapter(nn.Sequential(OrderedDict(fc1=nn.Linear(6, 3), fc2=reused[0]))))


def test_a_merged_adapter_composes_its_record_or_states_disjoint_data(saved_adapter):
    directory, spent = saved_adapter
    merged = peft.PeftModel.from_pretrained(_plain_model(), directory).merge_and_unload()
    merged.dpzoo_privacy = read_privacy_metadata(directory)
    assert _private(_new_adapter(merged)).get_epsilon(1e-5) == pytest.approx(spent, rel=1e-6)
    other = peft.PeftModel.from_pretrained(_plain_model(), directory).merge_and_unload()
    fresh = _new_adapter(other)
    fresh.dpzoo_privacy = {}
    assert "disjoint" in _private(fresh, steps=1).privacy_metadata(1e-5)["public_statistics"]


def test_an_adapter_dpzoo_trained_composes_through_its_merged_layers():
    """In-process, the engine's spending link moves to each merged base layer: a layer of the
    merged model reused in a new model composes the adapter's spending."""
    model = _new_adapter(_plain_model())
    first = _private(model, steps=3)
    merged = model.merge_and_unload()
    reused = nn.Sequential(OrderedDict(fc1=nn.Linear(6, 8), act=nn.ReLU(), fc2=merged.fc2))
    assert _private(_new_adapter(reused)).accountant.history == first.accountant.history


def test_an_untrained_adapter_merges_without_a_trace():
    merged = _new_adapter(_plain_model()).merge_and_unload()  # lora_B = 0: ΔW = 0
    assert _private(_new_adapter(merged)).accountant.history == []


def test_the_watch_installs_after_peft_without_importing_torch_first():
    import subprocess
    import sys

    code = (
        "import sys, dpzoo; assert 'torch' not in sys.modules; import peft; "
        "from torch.nn.modules import module as M; from dpzoo.integrations.peft_merge import _on_child_assigned; "
        "assert _on_child_assigned in M._global_module_registration_hooks.values()"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
