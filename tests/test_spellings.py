"""timm's and Hugging Face's spellings of a zoo entry's arguments: num_classes / num_labels, timm's
keyword arguments (features_only, global_pool, dropout rates), overrides when loading a saved
directory, hub ids as pretrained tags, ``save_pretrained`` after dpzoo's surgery, and the file
permissions of ``dpzoo.save``."""

from __future__ import annotations

import os
import stat

import pytest
import torch
from conftest import example_batch, output_tensor
from grad_reference import check_against_brute_force
from safetensors.torch import save_file
from torch import nn

import dpzoo
from dpzoo.models import split_name

CLASSIFIERS = ["resnet18-gn-bias", "vit-tiny-patch16", "efficientnet-lite0-gn-bias", "bert-base", "roberta-base"]
RESNET_SMALL = {"layers": [1, 1, 1, 1], "width": 8}


def _small(name: str, **extra):
    card = dpzoo.model_card(name)
    return {**card.test_overrides, **extra}


def _perturb(model: nn.Module, seed: int = 0) -> nn.Module:
    """Every parameter moved off its initial value (zero biases included), so a load that skipped
    one would show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


# --- 1. num_classes and num_labels; did-you-mean for every entry ----------------------------------


@pytest.mark.parametrize("name", CLASSIFIERS)
def test_num_labels_and_num_classes_are_one_setting(name):
    card = dpzoo.model_card(name)
    base = {k: v for k, v in card.test_overrides.items() if k != "num_classes"}
    assert "num_labels" in card.overrides and "num_classes" in card.overrides
    for kwargs in ({"num_labels": 7}, {"num_classes": 7, "num_labels": 7}):  # num_classes alone: test_zoo
        model = dpzoo.load(name, **base, **kwargs).eval()
        args, kw = example_batch(card)
        with torch.no_grad():
            assert output_tensor(model(*args, **kw)).shape[-1] == 7, kwargs
    with pytest.raises(dpzoo.OverrideError, match="num_classes=7.*num_labels=5|num_labels=5.*num_classes=7"):
        dpzoo.load(name, **base, num_classes=7, num_labels=5)


def _misspelt(name: str) -> tuple[str, str]:
    card = dpzoo.model_card(name)
    key = next(iter(card.test_overrides or {k: 0 for k in card.overrides if not k.startswith("(")}))
    return key, key[:-1]  # drop the last letter: "num_classes" -> "num_classe"


@pytest.mark.parametrize("name", dpzoo.list_models())
def test_every_entry_suggests_the_override_meant(name):
    key, typo = _misspelt(name)
    with pytest.raises(dpzoo.OverrideError, match=f"did you mean '{key}' for '{typo}'"):
        dpzoo.load(name, **{typo: 1})
    with pytest.raises(dpzoo.OverrideError, match="did you mean 'pretrained' for 'pretrainde'"):
        dpzoo.load(name, pretrainde=True)  # dpzoo.load's own keyword, misspelt


def test_user_builder_with_fixed_keywords_gets_a_did_you_mean():
    @dpzoo.register_model("spelling-probe-net")
    def build(pretrained: bool = False, width: int = 4):
        """A probe entry."""
        return dpzoo.make_dp_ready(nn.Linear(width, 2))

    try:
        assert dpzoo.load("spelling-probe-net", width=3).in_features == 3
        with pytest.raises(dpzoo.OverrideError, match="did you mean 'width' for 'widht'"):
            dpzoo.load("spelling-probe-net", widht=3)
    finally:
        dpzoo.unregister_model("spelling-probe-net")


# --- 2. timm's keyword arguments ------------------------------------------------------------------


def test_timm_keywords_reach_timm():
    r = dpzoo.load(
        "resnet18-gn-bias",
        **_small("resnet18-gn-bias"),
        drop_rate=0.25,
        drop_path_rate=0.1,
        drop_block_rate=0.05,
        global_pool="max",
        output_stride=16,
    )
    assert r.drop_rate == 0.25 and r.global_pool.pool_type == "max"
    assert r.layer4[0].drop_path.drop_prob == pytest.approx(0.1) and r.layer4[0].drop_block.drop_prob == 0.05
    assert r.forward_features(torch.randn(1, 3, 64, 64)).shape[-1] == 64 // 16  # last stage dilated, not strided
    v = dpzoo.load("vit-tiny-patch16", **_small("vit-tiny-patch16"), global_pool="avg", attn_drop_rate=0.2)
    assert v.global_pool == "avg" and v.blocks[0].attn.attn_drop.p == 0.2
    e = dpzoo.load("efficientnet-lite0-gn-bias", num_classes=10, global_pool="avgmax", drop_rate=0.3)
    assert e.global_pool.pool_type == "avgmax" and e.drop_rate == 0.3
    c = dpzoo.load("resnet18-gn-bias", **_small("resnet18-gn-bias"), global_pool="catavgmax")
    assert c.fc.in_features == 2 * 64  # timm's concatenated pooling doubles the classifier's inputs


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"features_only": "yes"}, "features_only must be True or False"),
        ({"out_indices": [1, 2]}, "pass both"),
        ({"features_only": True, "out_indices": [-1]}, "out_indices must be"),
        ({"output_stride": 12}, "output_stride must be one of 8, 16, 32"),
        ({"global_pool": "bogus"}, "bogus"),
        ({"drop_rate": 1.5}, r"drop_rate must be a number in \[0.0, 1.0\]"),
        ({"pretrained_cfg_overlay": "file.pth"}, "must be a dict"),
        ({"features_only": True, "num_classes": 10}, "features_only=True removes the classifier"),
    ],
)
def test_timm_keyword_errors(bad, match):
    with pytest.raises(dpzoo.OverrideError, match=match):
        dpzoo.load("resnet18-gn-bias", **RESNET_SMALL, **bad)


def _feature_loss(projections):
    def loss_fn(m, x):  # a nonlinear loss on every map: per-sample (Σ r·f)², summed over the batch
        return sum(((f * r).sum(dim=(1, 2, 3)) ** 2).sum() for f, r in zip(m(x), projections))

    return loss_fn


@pytest.mark.parametrize("mode", ["auto", "ghost", "instantiate"])
def test_features_only_resnet_is_dp_ready_and_its_norms_exact(mode):
    torch.manual_seed(0)
    model = dpzoo.load("resnet18-gn-bias", **RESNET_SMALL, features_only=True, out_indices=[1, 2, 4])
    assert type(model).__name__ == "FeatureListNet"
    assert dpzoo.check_dp_ready(model) == [] and dpzoo.find_inplace_ops(model, torch.randn(2, 3, 32, 32)) == []
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert any(isinstance(m, nn.GroupNorm) for m in model.modules())
    assert all(m.bias is not None for m in model.modules() if isinstance(m, nn.Conv2d))
    model = _perturb(model).double().eval()  # nonzero biases: their gradients matter
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 3, 32, 32, generator=g, dtype=torch.float64)
    with torch.no_grad():
        maps = model(x)
    assert [f.shape[1] for f in maps] == [8, 16, 64]
    projections = [torch.randn(f.shape[1:], generator=g, dtype=torch.float64) for f in maps]
    check_against_brute_force(model, {"x": x}, _feature_loss(projections), mode)


@pytest.mark.parametrize("name", ["resnet18-gn-bias", "vit-tiny-patch16"])
def test_num_classes_zero_gives_pooled_features_as_in_timm(name, tmp_path):
    src = _perturb(dpzoo.load(name, **_small(name)))
    torch.save(src.state_dict(), tmp_path / "c.pth")
    m = dpzoo.load(name, **_small(name, num_classes=0), weights=tmp_path / "c.pth").double()
    assert dpzoo.check_dp_ready(m) == [] and not any(n.startswith(("fc.", "head.")) for n, _ in m.named_parameters())
    for n, p in m.named_parameters():
        assert torch.equal(p, src.get_parameter(n).double()), n
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 3, 32, 32, generator=g, dtype=torch.float64)
    r = torch.randn(m.num_features, generator=g, dtype=torch.float64)
    assert m.eval()(x).shape == (3, m.num_features)
    check_against_brute_force(m, {"x": x}, lambda m, x: ((m(x) @ r) ** 2).sum(), "auto")


def test_vit_refuses_features_only_with_the_reason():
    with pytest.raises(dpzoo.OverrideError, match="FeatureGetterNet.*cls_token"):
        dpzoo.load("vit-tiny-patch16", **_small("vit-tiny-patch16", num_classes=0), features_only=True)


def test_features_only_card_documents_it():
    card = dpzoo.model_card("resnet18-gn-bias")
    assert {"features_only", "out_indices", "global_pool"} <= set(card.overrides)
    assert "features_only=True" in card.notes and "GroupNorm" in card.notes
    assert "features_only" in card.to_markdown()


def _timm_bn_resnet(num_classes=10):
    import timm

    torch.manual_seed(0)
    m = timm.create_model("resnet18", layers=[1, 1, 1, 1], channels=[8, 16, 32, 64], num_classes=num_classes)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.5, 0.5)
    return m


def test_features_only_loads_a_classifier_checkpoint_backbone(tmp_path):
    src = _timm_bn_resnet()
    torch.save(src.state_dict(), tmp_path / "c.pth")
    f = dpzoo.load(
        "resnet18-gn-bias", **RESNET_SMALL, features_only=True, out_indices=[1, 2], weights=tmp_path / "c.pth"
    )
    assert torch.equal(f.layer2[0].conv1.weight, src.layer2[0].conv1.weight)
    assert torch.equal(f.layer1[0].bn1.weight, src.layer1[0].bn1.weight)  # BN's γ copied into GroupNorm
    assert not hasattr(f, "layer3") and dpzoo.check_dp_ready(f) == []
    # a DP-ready checkpoint (dpzoo.save's file, with its added conv biases) gives the same backbone
    full = _perturb(dpzoo.load("resnet18-gn-bias", **_small("resnet18-gn-bias")))
    dpzoo.save(full, tmp_path / "s")
    f = dpzoo.load("resnet18-gn-bias", **RESNET_SMALL, features_only=True, weights=tmp_path / "s" / "model.safetensors")
    for n, p in f.named_parameters():
        assert torch.equal(p, full.get_parameter(n)), n
    assert torch.count_nonzero(f.layer3[0].conv2.bias) > 0


# --- 3. overrides when loading a saved directory ----------------------------------------------------


def test_saved_directory_takes_shape_neutral_overrides(tmp_path):
    src = _perturb(dpzoo.load("resnet18-gn-bias", **_small("resnet18-gn-bias")))
    dpzoo.save(src, tmp_path / "m")
    m = dpzoo.load(tmp_path / "m", drop_rate=0.3, global_pool="max", drop_path_rate=0.1)
    assert m.drop_rate == 0.3 and m.global_pool.pool_type == "max"
    _same_state(src, m)
    assert m.dpzoo_config["overrides"] == {**_small("resnet18-gn-bias"), "drop_rate": 0.3, "global_pool": "max",
                                           "drop_path_rate": 0.1}  # fmt: skip
    dpzoo.save(m, tmp_path / "again")  # the new overrides are recorded
    assert dpzoo.load(tmp_path / "again").drop_rate == 0.3


@pytest.mark.parametrize(
    "change",
    [{"num_classes": 5}, {"num_labels": 5}, {"width": 16}, {"layers": [1, 2, 1, 1]}, {"global_pool": "catavgmax"}],
)
def test_saved_directory_refuses_overrides_that_change_shapes(change, tmp_path):
    src = _perturb(dpzoo.load("resnet18-gn-bias", **_small("resnet18-gn-bias")))
    dpzoo.save(src, tmp_path / "m")
    with pytest.raises(dpzoo.OverrideError, match="shape.*weights=.*model.safetensors"):
        dpzoo.load(tmp_path / "m", **change)


def test_saved_vit_takes_dropout_but_not_a_pooling_with_other_tensors(tmp_path):
    src = _perturb(dpzoo.load("vit-tiny-patch16", **_small("vit-tiny-patch16")))
    dpzoo.save(src, tmp_path / "m")
    m = dpzoo.load(tmp_path / "m", proj_drop_rate=0.1, global_pool="token")
    assert m.blocks[0].attn.proj_drop.p == 0.1
    _same_state(src, m)
    with pytest.raises(dpzoo.OverrideError, match="fc_norm"):  # timm's 'avg' pooling normalises with fc_norm
        dpzoo.load(tmp_path / "m", global_pool="avg")


def test_the_suggested_way_to_a_new_head_works(tmp_path):
    src = _perturb(dpzoo.load("resnet18-gn-bias", **_small("resnet18-gn-bias")))
    dpzoo.save(src, tmp_path / "m")
    m = dpzoo.load("resnet18-gn-bias", weights=tmp_path / "m" / "model.safetensors", **RESNET_SMALL, num_classes=5)
    assert m.fc.out_features == 5
    for n, p in m.named_parameters():
        if not n.startswith("fc."):
            assert torch.equal(p, src.get_parameter(n)), n  # added conv biases included


def test_saved_hf_model_takes_dropout_overrides_and_refuses_a_new_head(tmp_path):
    src = _perturb(dpzoo.load("bert-base", **_small("bert-base")))
    dpzoo.save(src, tmp_path / "m")
    m = dpzoo.load(tmp_path / "m", hidden_dropout_prob=0.3, attention_probs_dropout_prob=0.2)
    assert m.bert.encoder.layer[0].output.dropout.p == 0.3
    assert m.bert.encoder.layer[0].attention.self.dropout.p == 0.2
    _same_state(src, m)
    for change in ({"num_labels": 7}, {"width": 64}):
        with pytest.raises(dpzoo.OverrideError, match="shape"):
            dpzoo.load(tmp_path / "m", **change)
    new = dpzoo.load("bert-base", weights=tmp_path / "m", num_labels=7)  # the suggested way to a new head
    sized = {k: v for k, v in _small("bert-base").items() if k != "num_classes"}
    from_file = dpzoo.load("bert-base", weights=tmp_path / "m" / "model.safetensors", **sized, num_classes=7)
    for m in (new, from_file):
        assert m.classifier.out_features == 7
        assert torch.equal(m.bert.encoder.layer[0].output.dense.weight, src.bert.encoder.layer[0].output.dense.weight)


def test_hf_model_sized_by_its_checkpoint_saves_and_loads_back(tmp_path):
    """A transformers model whose sizes came from a checkpoint (not from overrides) is rebuilt from
    the config saved beside it."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    BertModel(
        BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24)
    ).save_pretrained(tmp_path / "hf")
    src = _perturb(dpzoo.load("bert-base", weights=tmp_path / "hf", num_classes=3))
    dpzoo.save(src, tmp_path / "m")
    _same_state(src, dpzoo.load(tmp_path / "m"))
    assert dpzoo.load(tmp_path / "m", hidden_dropout_prob=0.0).config.hidden_dropout_prob == 0.0


def test_saved_seqrec_model_takes_dropout_and_refuses_more_items(tmp_path):
    src = _perturb(dpzoo.load("transformer-seqrec", **_small("transformer-seqrec")))
    dpzoo.save(src, tmp_path / "m")
    m = dpzoo.load(tmp_path / "m", dropout=0.3)
    assert m.config.dropout == 0.3 and any(isinstance(x, nn.Dropout) and x.p == 0.3 for x in m.modules())
    _same_state(src, m)
    with pytest.raises(dpzoo.OverrideError, match="shape"):
        dpzoo.load(tmp_path / "m", num_items=99)
    with pytest.raises(dpzoo.OverrideError, match="takes no pretrained"):
        dpzoo.load(tmp_path / "m", weights=tmp_path / "m" / "model.safetensors")


# --- 4. hub ids as tags -----------------------------------------------------------------------------


def test_split_name_keeps_hub_ids_whole():
    assert split_name("gpt2.openai-community/gpt2") == ("gpt2", "openai-community/gpt2")
    assert split_name("bert-base.google-bert/bert-base-uncased") == ("bert-base", "google-bert/bert-base-uncased")
    assert split_name("bert-base.org/model-v1.5") == ("bert-base", "org/model-v1.5")
    assert split_name("resnet18-gn-bias.a1_in1k") == ("resnet18-gn-bias", "a1_in1k")
    assert split_name("gpt2") == ("gpt2", None)

    @dpzoo.register_model("probe.v2")
    def probe(pretrained: bool = False, pretrained_tag=None):
        """An entry whose name has a dot."""
        return dpzoo.make_dp_ready(nn.Linear(2, 2))

    try:
        assert split_name("probe.v2") == ("probe.v2", None)
        assert split_name("probe.v2.org/model-v1.5") == ("probe.v2", "org/model-v1.5")
    finally:
        dpzoo.unregister_model("probe.v2")


@pytest.mark.parametrize(
    "name, kwargs, hub_id",
    [
        ("gpt2.openai-community/gpt2", {}, "openai-community/gpt2"),
        ("bert-base.google-bert/bert-base-uncased", {}, "google-bert/bert-base-uncased"),
        ("bert-base", {"pretrained_tag": "sentence-transformers/all-MiniLM-L6-v2"}, "sentence-transformers/all-MiniLM-L6-v2"),
        ("llama-tiny-bias.org/model-v1.5", {}, "org/model-v1.5"),
    ],
)  # fmt: skip
def test_hub_id_reaches_from_pretrained(name, kwargs, hub_id, monkeypatch):
    import transformers

    seen = []

    def from_pretrained(cls, source, *args, **kw):
        seen.append(source)
        raise OSError(f"{source} is not reachable (test)")

    entry = split_name(name)[0]
    cls = {
        "gpt2": transformers.GPT2LMHeadModel,
        "bert-base": transformers.BertForSequenceClassification,
        "llama-tiny-bias": transformers.LlamaForCausalLM,
    }[entry]
    monkeypatch.setattr(cls, "from_pretrained", classmethod(from_pretrained))
    with pytest.raises(dpzoo.CheckpointError, match="could not load"):
        dpzoo.load(name, pretrained=True, **kwargs)
    assert seen == [hub_id]


def test_a_local_directory_named_like_a_hub_id_loads_as_a_tag(tmp_path, monkeypatch):
    from transformers import BertConfig, BertModel

    monkeypatch.chdir(tmp_path)  # transformers resolves "org/model-v1.5" as a local directory first
    torch.manual_seed(0)
    base = BertModel(
        BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24)
    )
    base.save_pretrained("org/model-v1.5")
    for m in (
        dpzoo.load("bert-base.org/model-v1.5", pretrained=True, num_classes=3),
        dpzoo.load("bert-base", pretrained=True, pretrained_tag="org/model-v1.5", num_labels=3),
    ):
        assert m.dpzoo_config["pretrained_tag"] == "org/model-v1.5" and m.classifier.out_features == 3
        assert torch.equal(m.bert.encoder.layer[0].output.dense.weight, base.encoder.layer[0].output.dense.weight)
    with pytest.raises(dpzoo.OverrideError, match="pretrained=True"):
        dpzoo.load("bert-base.org/model-v1.5")
    with pytest.raises(dpzoo.OverrideError, match="give one"):
        dpzoo.load("bert-base.org/model-v1.5", pretrained=True, pretrained_tag="org/other")


# --- 5. save_pretrained after dpzoo's surgery ------------------------------------------------------


@pytest.mark.parametrize("name", ["llama-tiny-bias", "gpt2", "bert-base"])
def test_save_pretrained_of_a_patched_model_loads_back(name, tmp_path):
    card = dpzoo.model_card(name)
    src = _perturb(dpzoo.load(name, **card.test_overrides)).eval()
    src.save_pretrained(tmp_path / "hf")
    got = dpzoo.load(name, weights=tmp_path / "hf", **card.test_overrides).eval()
    _same_state(src, got)
    args, kw = example_batch(card)
    with torch.no_grad():
        assert torch.equal(output_tensor(src(*args, **kw)), output_tensor(got(*args, **kw)))
    if name == "llama-tiny-bias":  # the biases HF's config does not know about
        for n in ("model.layers.0.input_layernorm.bias", "model.layers.1.mlp.down_proj.bias", "model.norm.bias"):
            assert torch.count_nonzero(got.get_parameter(n)) > 0 and torch.equal(
                got.get_parameter(n), src.get_parameter(n)
            )
    if name == "gpt2":
        assert got.lm_head.weight is got.transformer.wte.weight


def test_weights_file_of_a_patched_llama_loads_and_foreign_biases_are_named(tmp_path):
    src = _perturb(dpzoo.load("llama-tiny-bias"))
    sd = {k: v.contiguous() for k, v in src.state_dict().items()}
    save_file(sd, str(tmp_path / "w.safetensors"))
    _same_state(src, dpzoo.load("llama-tiny-bias", weights=tmp_path / "w.safetensors"))
    sd["lm_head.bias"] = torch.ones(src.lm_head.out_features)  # a bias the zoo entry leaves out
    save_file(sd, str(tmp_path / "x.safetensors"))
    with pytest.raises(dpzoo.CheckpointError, match="lm_head.bias"):
        dpzoo.load("llama-tiny-bias", weights=tmp_path / "x.safetensors")


# --- 6. saved files follow the umask --------------------------------------------------------------


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o002], ids=oct)
def test_saved_files_follow_the_umask(mask, tmp_path):
    model = dpzoo.load("gpt2", **_small("gpt2"))
    old = os.umask(mask)
    try:
        for _ in range(2):  # a new directory, then overwriting it
            out = dpzoo.save(model, tmp_path / "m")
            assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~mask
            files = sorted(out.iterdir())
            assert {f.name for f in files} == {"model.safetensors", "dpzoo_config.json", "config.json", "README.md"}
            for f in files:
                assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~mask, f.name
    finally:
        os.umask(old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # nothing half-written left beside it
