"""resnet50-gn-bias's default pretrained tag is timm's GroupNorm-trained ResNet-50 (resnet50_gn),
whose tensors are the DP-ready architecture's: it loads with no conversion and computes what timm's
model computes. The hub is not reachable here, so timm's pretrained fetch is replaced by a locally
built model of the same layout; a GroupNorm checkpoint given as weights=PATH loads the same way."""

from __future__ import annotations

import timm
import torch

import dpzoo


def _local_resnet50_gn(num_classes=10):
    torch.manual_seed(1)
    model = timm.create_model("resnet50_gn", num_classes=num_classes).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bn" in name or "downsample.1" in name:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.1)  # GroupNorm γ, β away from 1, 0
    return model


def test_the_default_tag_loads_groupnorm_weights_as_they_are(monkeypatch):
    source = _local_resnet50_gn()
    fetched = []

    def fake_pretrained(name, kwargs):
        fetched.append(name)
        return source

    monkeypatch.setattr("dpzoo.models._timm.timm_pretrained", fake_pretrained)
    model = dpzoo.load("resnet50-gn-bias", pretrained=True, num_classes=10).eval()
    assert fetched == ["resnet50_gn.a1h_in1k"]
    x = torch.randn(2, 3, 64, 64)
    assert torch.equal(model(x), source(x))  # the zero biases added change nothing
    groups = model.dpzoo_patch_report.groupnorm  # the architecture's norms are GroupNorm(32), as resnet50_gn's
    assert groups and all(g == 32 for _, g in groups.values())
    dpzoo.load("resnet50-gn-bias", pretrained=True, pretrained_tag="a1_in1k", num_classes=10)
    assert fetched[-1] == "resnet50.a1_in1k"  # the BatchNorm tag, converted as before


def test_a_groupnorm_checkpoint_loads_by_weights(tmp_path):
    source = _local_resnet50_gn()
    torch.save(source.state_dict(), tmp_path / "resnet50_gn.pth")
    model = dpzoo.load("resnet50-gn-bias", weights=tmp_path / "resnet50_gn.pth", num_classes=10).eval()
    x = torch.randn(2, 3, 64, 64)
    assert torch.equal(model(x), source(x))
