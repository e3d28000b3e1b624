"""nf-resnet50: timm's normaliser-free ResNet-50, DP-ready as it is. Its pretrained tag goes through
timm's pretrained path (replaced here by a locally built model of the same layout: the hub is not
reachable) and loads with no conversion; a timm checkpoint loads by weights=PATH and by
load_state_dict; the small configurations (depths / channels / stem_chs, which timm keeps in a
configuration object) build the same architecture; per-sample norms are exact in every mode."""

from __future__ import annotations

import dataclasses

import pytest
import timm
import torch
from grad_reference import check_against_brute_force
from timm.models.nfnet import NormFreeNet, model_cfgs

import dpzoo
from dpzoo.errors import OverrideError

SMALL = {"num_classes": 10, "depths": [1, 1, 1, 1], "channels": [16, 32, 64, 128], "stem_chs": 8}


def _timm_small(seed=0):
    torch.manual_seed(seed)
    cfg = dataclasses.replace(model_cfgs["nf_resnet50"], depths=(1, 1, 1, 1), channels=(16, 32, 64, 128), stem_chs=8)
    model = NormFreeNet(cfg=cfg, num_classes=10).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gain", "bias")):
                p.normal_(1.0 if name.endswith("gain") else 0.0, 0.2)  # away from timm's init: a dropped one shows
    return model


def test_the_pretrained_tag_goes_through_timm_and_loads_as_it_is(monkeypatch):
    torch.manual_seed(1)
    source = timm.create_model("nf_resnet50", num_classes=10).eval()
    fetched = []

    def fake_pretrained(name, kwargs):
        fetched.append((name, kwargs))
        return source

    monkeypatch.setattr("dpzoo.models._timm.timm_pretrained", fake_pretrained)
    model = dpzoo.load("nf-resnet50", pretrained=True, num_classes=10).eval()
    assert [name for name, _ in fetched] == ["nf_resnet50.ra2_in1k"]
    x = torch.randn(1, 3, 64, 64)
    assert torch.equal(model(x), source(x))  # no conversion, no added bias: the network as timm trained it
    assert dpzoo.check_dp_ready(model) == []
    norms = (torch.nn.modules.batchnorm._NormBase, torch.nn.GroupNorm, torch.nn.LayerNorm)
    assert not [n for n, m in model.named_modules() if isinstance(m, norms)]


def test_a_timm_checkpoint_of_the_small_layout_loads_by_weights_and_by_load_state_dict(tmp_path):
    source = _timm_small()
    torch.save(source.state_dict(), tmp_path / "nf.pth")
    x = torch.randn(2, 3, 32, 32)
    loaded = dpzoo.load("nf-resnet50", weights=tmp_path / "nf.pth", **SMALL).eval()
    assert torch.equal(loaded(x), source(x))
    fresh = dpzoo.load("nf-resnet50", **SMALL).eval()
    fresh.load_state_dict(source.state_dict())
    assert torch.equal(fresh(x), source(x))
    dpzoo.save(loaded, tmp_path / "saved")
    assert torch.equal(dpzoo.load(tmp_path / "saved").eval()(x), source(x))


def test_the_configuration_overrides_build_timms_architecture():
    model = dpzoo.load("nf-resnet50", **SMALL)
    reference = _timm_small()
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]
    assert model.stem.conv.out_channels == 8 and model.num_features == reference.num_features == 128
    with pytest.raises(OverrideError, match="depths"):
        dpzoo.load("nf-resnet50", depths=[1, 1, 1])


def test_per_sample_norms_are_exact_in_every_mode():
    model = dpzoo.load("nf-resnet50", **SMALL).double().train()
    inputs = {"x": torch.randn(3, 3, 32, 32, dtype=torch.float64)}
    weights = torch.randn(10, dtype=torch.float64)

    def loss_fn(m, x):  # per-sample terms summed (the reference runs one sample at a time)
        return (m(x).tanh() * weights).sum()

    for mode in ("ghost", "instantiate"):
        check_against_brute_force(model, inputs, loss_fn, mode)
