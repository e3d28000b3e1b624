"""A DP-trained model keeps its spending when it is reused or re-saved, not only when it is
trained again as the same object. Found by the third independent audit (each composed nothing,
so a second run on the same data reported only its own ε):

* the trained model inside a new module (a wrapper with a new head), or one of its layers reused;
* a Hugging Face backbone DP-trained inside a custom classifier, saved with its own
  ``save_pretrained`` and reloaded;
* a model ``dpzoo.save``d with a record (an Opacus run) reloaded through ``from_pretrained`` from a
  relative path after a ``chdir``, or re-saved with ``save_pretrained`` and reloaded from the copy.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpzoo
from dpzoo.privacy.accounting.accountant import Accountant

GEN = torch.Generator().manual_seed(0)
X, Y = torch.randn(64, 6, generator=GEN), torch.randint(0, 3, (64,), generator=GEN)
IDS = torch.randint(1, 40, (64, 5), generator=GEN)


def _train(model, data, steps):
    """(engine, the history it composed before its own steps) after ``steps`` DP steps."""
    engine = dpzoo.PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=16),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            self_check=False,
            target_delta=1e-5,
        )
    before = [list(h) for h in engine.accountant.history]
    for _, (x, y) in zip(range(steps), loader):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return engine, before


@pytest.fixture()
def trained_mlp():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    engine, _ = _train(m, TensorDataset(X, Y), 4)
    engine.detach()
    return m, engine.accountant.history


def test_a_trained_model_inside_a_new_module_composes_its_spending(trained_mlp):
    m, spent = trained_mlp
    assert spent == [[1.0, 0.25, 4]]
    engine, composed = _train(nn.Sequential(m, nn.Linear(3, 3)), TensorDataset(X, Y), 4)
    assert composed == spent
    assert sum(h[2] for h in engine.accountant.history) == 8  # ε is for both runs' steps


def test_a_reused_layer_composes_and_a_third_run_counts_each_history_once(trained_mlp):
    m, spent = trained_mlp
    wrapper = nn.Sequential(m[0], nn.Tanh(), nn.Linear(8, 3))
    engine, composed = _train(wrapper, TensorDataset(X, Y), 2)
    assert composed == spent
    engine.detach()
    _, third = _train(wrapper, TensorDataset(X, Y), 0)  # the wrapper's link already holds m's history
    assert sum(h[2] for h in third) == 6  # 4 + 2, not 4 + (4 + 2)


def test_stated_disjoint_data_on_the_new_model_composes_nothing(trained_mlp):
    m, _ = trained_mlp
    wrapper = nn.Sequential(m, nn.Linear(3, 3))
    wrapper.dpzoo_privacy = {}
    _, composed = _train(wrapper, TensorDataset(X, Y), 0)
    assert composed == []


class _Classifier(nn.Module):
    def __init__(self, backbone):
        super().__init__()
        self.backbone, self.head = backbone, nn.Linear(16, 3)

    def forward(self, ids):
        return self.head(self.backbone(input_ids=ids).last_hidden_state[:, -1])


def test_a_backbone_saved_on_its_own_carries_the_spending(tmp_path):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=1, n_head=2, n_positions=8)
    clf = _Classifier(transformers.GPT2Model(config))
    engine, _ = _train(clf, TensorDataset(IDS, Y), 3)
    engine.detach()
    clf.backbone.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dpzoo_privacy"]["history"] == [[1.0, 0.25, 3]]
    _, composed = _train(_Classifier(transformers.GPT2Model.from_pretrained(tmp_path)), TensorDataset(IDS, Y), 0)
    assert composed == [[1.0, 0.25, 3]]


@pytest.fixture()
def opacus_style_save(tmp_path):
    """A zoo BERT saved by dpzoo.save with a record given by hand (what an Opacus run passes)."""
    model = dpzoo.load("bert-base", **dpzoo.model_card("bert-base").test_overrides)
    history = [[1.0, 0.25, 100]]
    record = {"epsilon": Accountant("rdp", history).get_epsilon(1e-5), "delta": 1e-5, "accountant": "rdp"}
    record.update(steps=100, sample_rate=0.25, noise_multiplier=1.0)
    directory = tmp_path / "dp_run"
    dpzoo.save(model, directory, privacy=record)
    vocab = model.config.vocab_size
    data = TensorDataset(torch.randint(1, vocab, (64, 6), generator=GEN), torch.randint(0, 2, (64,), generator=GEN))
    return directory, data, history


def _hf_prior(model, data):
    engine = dpzoo.PrivacyEngine()
    engine.make_private(
        module=model,
        optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
        data_loader=DataLoader(data, batch_size=16),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        target_delta=1e-5,
        self_check=False,
    )
    return engine.accountant.history


def test_a_dpzoo_saved_record_survives_a_relative_path_and_a_re_save(opacus_style_save, tmp_path, monkeypatch):
    directory, data, history = opacus_style_save
    auto = transformers.AutoModelForSequenceClassification
    assert json.loads((directory / "config.json").read_text())["dpzoo_privacy"]["history"] == history
    monkeypatch.chdir(directory.parent)
    relative = auto.from_pretrained("dp_run")
    monkeypatch.chdir(tmp_path.anchor)
    assert _hf_prior(relative, data) == history
    copy_dir = tmp_path / "copy"
    auto.from_pretrained(str(directory)).save_pretrained(copy_dir)
    assert not (copy_dir / "dpzoo_privacy.json").exists() and _hf_prior(auto.from_pretrained(copy_dir), data) == history
    assert os.path.isdir(directory)
