"""convnext-tiny: the layer-scale surgery keeps timm's outputs bit for bit (both MLP layouts), timm
checkpoints load through weights=PATH and load_state_dict (their `gamma` keys included), and a
ConvNeXt that only make_dp_ready touched gets exact per-sample norms."""

from __future__ import annotations

import pytest
import timm
import torch
from grad_reference import check_against_brute_force

import dpzoo

SMALL = {"num_classes": 10, "depths": [1, 1, 1, 1], "dims": [8, 16, 32, 64], "ls_init_value": 0.5}


def _timm(conv_mlp=False, seed=0):
    torch.manual_seed(seed)
    model = timm.create_model("convnext_tiny", conv_mlp=conv_mlp, **SMALL).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gamma"):
                p.uniform_(0.5, 1.5)  # every channel its own scale: a moved γ that is misapplied shows
    return model


@pytest.mark.parametrize("conv_mlp", [False, True])
def test_the_surgery_keeps_timms_outputs_bit_for_bit(conv_mlp):
    model = _timm(conv_mlp)
    x = torch.randn(3, 3, 32, 32)
    expected = model(x)
    patched = dpzoo.make_dp_ready(model)
    assert torch.equal(patched(x), expected)
    moved = [n for n, what in patched.dpzoo_patch_report.layers_replaced.items() if "LayerScale" in what]
    gammas = [n for n, _ in patched.named_parameters() if n.endswith("gamma")]
    assert len(moved) == 4 and len(gammas) == 4 and all(n.endswith(".mlp.1.gamma") for n in gammas)
    assert dpzoo.check_dp_ready(patched) == []


def test_a_timm_checkpoint_loads_by_weights_and_by_load_state_dict(tmp_path):
    source = _timm()
    path = tmp_path / "convnext.pth"
    torch.save(source.state_dict(), path)
    x = torch.randn(2, 3, 32, 32)
    loaded = dpzoo.load("convnext-tiny", weights=path, **SMALL).eval()
    assert torch.equal(loaded(x), source(x))
    fresh = dpzoo.load("convnext-tiny", **SMALL).eval()
    fresh.load_state_dict(source.state_dict())  # timm's keys: gamma, mlp.fc1.weight, ...
    assert torch.equal(fresh(x), source(x))
    dpzoo.save(loaded, tmp_path / "saved")
    assert torch.equal(dpzoo.load(tmp_path / "saved").eval()(x), source(x))


def test_layer_scale_norms_are_exact_after_make_dp_ready_alone():
    model = dpzoo.make_dp_ready(_timm().double().train())
    inputs = {"x": torch.randn(4, 3, 32, 32, dtype=torch.float64)}

    def loss_fn(m, x):
        return m(x).square().sum()

    for mode in ("ghost", "instantiate"):
        check_against_brute_force(model, inputs, loss_fn, mode)
