"""Every zoo entry, in its small configuration: builds, runs, is DP-ready, round-trips."""

from __future__ import annotations

import copy
import fnmatch

import pytest
import torch
from conftest import example_batch, output_tensor
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd

import dpzoo
from dpzoo.surgery import find_inplace_ops

ALL = dpzoo.list_models()
REQUIRED = [
    "resnet18-gn-bias",
    "resnet34-gn-bias",
    "resnet50-gn-bias",
    "vit-tiny-patch16",
    "vit-small-patch16",
    "vit-base-patch16",
    "gpt2",
    "bert-base",
    "roberta-base",
    "llama-bias",
    "llama-tiny-bias",
]


def test_required_entries_are_registered():
    assert set(REQUIRED) <= set(ALL)


@pytest.mark.parametrize("name", ALL)
def test_builds_runs_forward_and_backward(name, small_model):
    torch.manual_seed(0)
    model, card = small_model(name)
    model.train()
    args, kwargs = example_batch(card)
    out = output_tensor(model(*args, **kwargs))
    assert torch.isfinite(out).all()
    out.float().pow(2).mean().backward()
    missing_grad = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    # every parameter takes part in the forward pass (pooler-free heads etc. aside)
    allowed = ("*pooler*",)
    assert [n for n in missing_grad if not any(fnmatch.fnmatch(n, a) for a in allowed)] == []


@pytest.mark.parametrize("name", ALL)
def test_no_batchnorm_and_biases_where_the_card_says(name, small_model):
    model, card = small_model(name)
    assert not [n for n, m in model.named_modules() if isinstance(m, _BatchNorm)]
    for n, m in model.named_modules():
        if isinstance(m, (nn.Linear, _ConvNd)) and not any(fnmatch.fnmatch(n, p) for p in card.bias_exempt):
            assert m.bias is not None, f"{name}: {n} has no bias"
    assert dpzoo.check_dp_ready(model, bias_exempt=card.bias_exempt) == []


@pytest.mark.parametrize("name", ALL)
def test_no_inplace_ops_on_tracked_tensors(name, small_model):
    model, card = small_model(name)
    model.train()
    args, kwargs = example_batch(card)
    assert find_inplace_ops(model, *args, **kwargs) == []


@pytest.mark.parametrize("name", ALL)
def test_zero_biases_leave_outputs_identical(name):
    """Adding zero biases (BiTFiT-Add) must not change the function: compare against the
    entry built without biases, with the same weights, bit for bit."""
    card = dpzoo.model_card(name)
    torch.manual_seed(1)
    patched = dpzoo.load(name, **card.test_overrides)
    added = patched.dpzoo_patch_report.biases_added
    # Rebuild the same model without BiTFiT-Add by removing exactly the added biases.
    plain = copy.deepcopy(patched)
    for mod_name in added:
        m = plain.get_submodule(mod_name)
        if isinstance(m, dpzoo.nn.RMSNorm):
            m.bias = None
        elif isinstance(m, nn.MultiheadAttention):
            m.in_proj_bias = None
        else:
            m.bias = None
    patched.eval(), plain.eval()
    args, kwargs = example_batch(card, batch_size=3, seed=5)
    with torch.no_grad():
        a = output_tensor(patched(*args, **kwargs))
        b = output_tensor(plain(*args, **kwargs))
    assert torch.equal(a, b)
    if name.startswith(("resnet", "llama")):
        assert added, f"{name} should have had biases added"


def test_bias_init_normal_changes_biases_reproducibly():
    a = dpzoo.load(
        "resnet18-gn-bias", num_classes=3, layers=[1, 1, 1, 1], width=8, bias_init="normal", bias_std=0.01, bias_seed=3
    )
    b = dpzoo.load(
        "resnet18-gn-bias", num_classes=3, layers=[1, 1, 1, 1], width=8, bias_init="normal", bias_std=0.01, bias_seed=3
    )
    ba, bb = a.conv1.bias.detach(), b.conv1.bias.detach()
    assert ba.abs().sum() > 0 and torch.equal(ba, bb)
    assert 0.001 < ba.std().item() < 0.05


def test_unpatched_timm_resnet_is_what_the_zoo_fixes():
    """The zoo entry differs from plain timm exactly by dpzoo's patches."""
    import timm

    plain = timm.create_model("resnet18", num_classes=10, layers=[1, 1, 1, 1], channels=[8, 16, 32, 64], stem_width=8)
    assert any(isinstance(m, nn.BatchNorm2d) for m in plain.modules())
    assert dpzoo.check_dp_ready(plain)
    zoo = dpzoo.load("resnet18-gn-bias", num_classes=10, layers=[1, 1, 1, 1], width=8)
    assert dpzoo.check_dp_ready(zoo) == []
    assert {k for k in plain.state_dict() if "running" not in k and "num_batches" not in k} <= set(zoo.state_dict())


def test_gpt2_tied_embedding_is_tracked(small_model):
    model, _ = small_model("gpt2")
    groups = model.dpzoo_patch_report.tied_groups
    assert len(groups) == 1
    assert set(groups[0].names) == {"transformer.wte.weight", "lm_head.weight"}
    assert model.lm_head.weight is model.transformer.wte.weight
    untied, _ = small_model("gpt2", tie_word_embeddings=False)
    assert untied.dpzoo_patch_report.tied_groups == []


def test_llama_projections_and_norms_get_biases(small_model):
    model, _ = small_model("llama-tiny-bias")
    layer = model.model.layers[0]
    for proj in (
        layer.self_attn.q_proj,
        layer.self_attn.k_proj,
        layer.self_attn.v_proj,
        layer.self_attn.o_proj,
        layer.mlp.gate_proj,
        layer.mlp.up_proj,
        layer.mlp.down_proj,
    ):
        assert proj.bias is not None and torch.count_nonzero(proj.bias) == 0
    assert isinstance(layer.input_layernorm, dpzoo.nn.RMSNorm)
    assert isinstance(model.model.norm, dpzoo.nn.RMSNorm)
    assert model.lm_head.bias is None  # exempt on purpose (card)


def test_overrides_change_sizes():
    m = dpzoo.load("vit-tiny-patch16", num_classes=7, img_size=32, patch_size=8, depth=3, width=48, num_heads=3)
    assert len(m.blocks) == 3 and m.embed_dim == 48 and m.head.out_features == 7
    m = dpzoo.load("resnet18-gn-bias", num_classes=4, layers=[1, 2, 1, 1], width=16)
    assert m.fc.out_features == 4 and len(m.layer2) == 2 and m.layer1[0].conv1.out_channels == 16
    m = dpzoo.load("gpt2", vocab_size=100, num_layers=1, width=16, num_heads=2)
    assert m.config.vocab_size == 100 and m.config.n_layer == 1
    m = dpzoo.load(
        "bert-base", num_classes=5, vocab_size=100, num_layers=1, width=16, num_heads=2, intermediate_size=32
    )
    assert m.classifier.out_features == 5


def test_gn_groups_override_and_auto_rule():
    m = dpzoo.load("resnet18-gn-bias", num_classes=2, layers=[1, 1, 1, 1], width=8)
    for n, (c, g) in m.dpzoo_patch_report.groupnorm.items():
        assert c % g == 0 and (c // g >= 2 or g == 1) and g <= 32
        assert m.get_submodule(n).num_groups == g
    m = dpzoo.load("resnet18-gn-bias", num_classes=2, layers=[1, 1, 1, 1], width=8, gn_groups=4)
    assert {gn.num_groups for gn in m.modules() if isinstance(gn, nn.GroupNorm)} == {4}
    with pytest.raises(dpzoo.PatchError, match="not divisible"):
        dpzoo.load("resnet18-gn-bias", num_classes=2, layers=[1, 1, 1, 1], width=8, gn_groups=3)


def test_full_size_cards_match_paper_bias_share():
    """DP-BiTFiT Table 1: ResNet18 has few bias parameters; after BiTFiT-Add it has more
    (every conv gets one) but still < 0.1% of parameters (§3.4)."""
    with torch.device("meta"):
        r18 = dpzoo.load("resnet18-gn-bias")
        llama = dpzoo.load("llama-bias")
    s = dpzoo.summary(r18)
    assert 11_000_000 < s.total_params < 12_500_000
    assert 0.04 < s.bias_percent < 0.1
    s = dpzoo.summary(llama)
    assert 6.5e9 < s.total_params < 7e9
    # every RMSNorm replaced, even on meta: 2 per layer + the final one
    assert s.norm_layers == {"RMSNorm": 65}
    # q,k,v,o + gate,up,down + 2 norms per layer, final norm; no lm_head bias (card)
    per_layer = 4 * 4096 + 2 * 11008 + 4096 + 2 * 4096
    assert s.bias_params == 32 * per_layer + 4096
    assert s.bias_percent < 0.03  # "only 0.03% parameters on LLAMA2-7B" (§3.4)
