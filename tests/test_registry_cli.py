"""Registry behaviour (timm-style), model cards in models/ kept in sync, and the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import dpzoo
from dpzoo.cli import main
from dpzoo.errors import InvalidArgumentError

ROOT = Path(__file__).resolve().parents[1]


def test_list_models_patterns():
    assert dpzoo.list_models("resnet*") == ["resnet18-gn-bias", "resnet34-gn-bias", "resnet50-gn-bias"]
    assert dpzoo.list_models(["gpt2", "bert*"]) == ["bert-base", "gpt2"]
    assert dpzoo.list_models("nothing-like-this*") == []
    assert set(dpzoo.list_models(pretrained=True)) <= set(dpzoo.list_models())
    assert "llama-tiny-bias" not in dpzoo.list_models(pretrained=True)


@pytest.mark.parametrize("name", dpzoo.list_models())
def test_every_entry_has_a_complete_card_in_models_dir(name):
    card = dpzoo.model_card(name)
    assert card.summary and card.architecture and card.patches and card.license and card.papers
    assert card.weight_source and card.test_overrides is not None and card.example_input
    path = ROOT / "models" / f"{name}.md"
    assert path.exists(), f"models/{name}.md missing: run `dpzoo cards --write models`"
    assert path.read_text() == card.to_markdown(), f"models/{name}.md is stale: run `dpzoo cards --write models`"


def test_no_stray_cards():
    cards = {p.stem for p in (ROOT / "models").glob("*.md")} - {"README"}
    assert cards == set(dpzoo.list_models())


def test_a_card_renders_the_measured_dp_results_of_its_entry(tmp_path, monkeypatch):
    import json

    from dpzoo import registry

    measured = {"model": "wrn16-4-gn", "data": "digits", "configuration": "small", "epsilon": 7.99, "delta": 1e-5,
                "accountant": "rdp", "steps": 220, "runs": 3, "test_accuracy_mean": 0.5123,
                "test_accuracy_min": 0.5, "test_accuracy_max": 0.53, "non_private_test_accuracy": 0.9,
                "command": "dpzoo train wrn16-4-gn --epsilon 8", "measured": {"date": "2026-11-27", "machine": "m"}}  # fmt: skip
    (tmp_path / "dp_results.json").write_text(json.dumps({"wrn16-4-gn": measured}))
    monkeypatch.setattr(registry, "RESULTS_FILE", tmp_path / "dp_results.json")
    card = dpzoo.model_card("wrn16-4-gn").to_markdown()
    assert "| digits | small | 7.99 (1e-05, rdp) | 220 | 51.2% (50.0%–53.0%) | 90.0% |" in card
    assert "None measured yet" in dpzoo.model_card("resnet18-gn-bias").to_markdown()


def test_a_language_card_renders_its_measured_metric(tmp_path, monkeypatch):
    import json

    from dpzoo import registry

    measured = {"model": "gpt2", "kind": "lm", "data": "stdlib sentences", "configuration": "small", "epsilon": 7.99,
                "delta": 1e-5, "accountant": "rdp", "steps": 180, "runs": 3, "metric": "test_bits_per_byte",
                "test_bits_per_byte_mean": 4.5123, "test_bits_per_byte_min": 4.4, "test_bits_per_byte_max": 4.6,
                "non_private_test_bits_per_byte": 3.9, "uniform_bits_per_byte": 8.0, "train_size": 1109,
                "test_size": 277, "tokens": "UTF-8 bytes", "lr": 0.003, "batch_size": 128, "epochs": 20,
                "max_grad_norm": 1.0, "noise_multiplier": 1.2,
                "command": "python benchmarks/zoo_text_results.py gpt2", "measured": {"date": "2026-11-27", "machine": "m"}}  # fmt: skip
    classifier = {**measured, "model": "bert-base", "kind": "classifier", "metric": "test_accuracy",
                  "test_accuracy_mean": 0.3456, "test_accuracy_min": 0.3, "test_accuracy_max": 0.4,
                  "non_private_test_accuracy": 0.5, "chance_accuracy": 0.2, "majority_test_accuracy": 0.29}  # fmt: skip
    del classifier["uniform_bits_per_byte"]
    (tmp_path / "dp_results.json").write_text(json.dumps({"gpt2": measured, "bert-base": classifier}))
    monkeypatch.setattr(registry, "RESULTS_FILE", tmp_path / "dp_results.json")
    card = dpzoo.model_card("gpt2").to_markdown()
    assert "| test bits per byte (lower is better) | without DP |" in card
    assert (
        "| 7.99 (1e-05, rdp) | 180 | 4.51 (4.40–4.60) | 3.90 | `python benchmarks/zoo_text_results.py gpt2` |" in card
    )
    assert "Measured by `python benchmarks/zoo_text_results.py gpt2`" in card and "uniform guess is 8 bits" in card
    card = dpzoo.model_card("bert-base").to_markdown()
    assert "| test accuracy | without DP |" in card and "| 34.6% (30.0%–40.0%) | 50.0% |" in card
    assert "chance is 20%, always the most frequent family 29.0%" in card


def test_every_language_entry_has_a_measured_result():
    """benchmarks/zoo_text_results.py measured every language entry (dpzoo/models/dp_results.json)."""
    import json

    from dpzoo.registry import RESULTS_FILE

    packaged = json.loads(RESULTS_FILE.read_text())
    tasks = ("sequence-classification", "causal-lm", "text2text-generation")
    language = [n for n in dpzoo.list_models() if dpzoo.model_card(n).task in tasks]
    assert len(language) >= 9 and all(packaged.get(n, {}).get("metric") for n in language)
    for name in language:
        r = packaged[name]
        assert r["command"] == f"python benchmarks/zoo_text_results.py {name}" and r["epsilon"] <= 8.0


def test_the_packaged_results_are_the_benchmarks(monkeypatch):
    """dpzoo/models/dp_results.json holds what benchmarks/zoo_results.py wrote for each entry."""
    import json

    from dpzoo.registry import RESULTS_FILE

    packaged = json.loads(RESULTS_FILE.read_text())
    for name, result in packaged.items():
        written = ROOT / "benchmarks" / "results" / "zoo" / f"{name}.json"
        assert name in dpzoo.list_models() and json.loads(written.read_text()) == result


def test_register_user_model(tmp_path):
    class Tiny(nn.Module):
        def __init__(self, width=4):
            super().__init__()
            self.conv = nn.Conv2d(3, width, 3, bias=False)
            self.bn = nn.BatchNorm2d(width)
            self.act = nn.ReLU(inplace=True)

        def forward(self, x):
            return self.act(self.bn(self.conv(x))).mean((2, 3))

    @dpzoo.register_model("test-tiny-cnn")
    def test_tiny_cnn(pretrained=False, weights=None, **kw):
        """A tiny CNN registered by a test."""
        return dpzoo.make_dp_ready(Tiny(**kw))

    try:
        assert "test-tiny-cnn" in dpzoo.list_models()
        assert dpzoo.model_card("test-tiny-cnn").summary == "A tiny CNN registered by a test."
        m = dpzoo.load("test-tiny-cnn", width=6)
        assert dpzoo.check_dp_ready(m) == [] and m.conv.bias is not None
        dpzoo.save(m, tmp_path / "t")
        r = dpzoo.load(tmp_path / "t")
        assert r.conv.weight.shape[0] == 6 and torch.equal(r.conv.weight, m.conv.weight)
        with pytest.raises(InvalidArgumentError, match="already registered"):
            dpzoo.register_model("test-tiny-cnn")(lambda **kw: None)
    finally:
        if dpzoo.is_model("test-tiny-cnn"):
            dpzoo.unregister_model("test-tiny-cnn")


def test_create_model_is_load():
    assert dpzoo.create_model is dpzoo.load


def test_cli_list_and_card(capsys):
    assert main(["list", "vit*"]) == 0
    out = capsys.readouterr().out
    assert "vit-tiny-patch16" in out and "resnet" not in out
    assert main(["card", "gpt2"]) == 0
    assert capsys.readouterr().out == dpzoo.model_card("gpt2").to_markdown()


def test_cli_prepare_saves_a_loadable_model(tmp_path, capsys):
    assert main(["prepare", "resnet18-gn-bias", "--small", "--set", "num_classes=4", "--out", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "BatchNorm -> GroupNorm" in out and "forward/backward" in out
    m = dpzoo.load(tmp_path / "r")
    assert m.fc.out_features == 4


def test_cli_reports_user_errors_without_traceback(capsys):
    assert main(["summary", "resnet18-gnbias"]) == 2
    err = capsys.readouterr().err
    assert "Did you mean: resnet18-gn-bias" in err and "Traceback" not in err
    assert main(["prepare", "resnet18-gn-bias", "--set", "colour=red"]) == 2
    assert "does not accept" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["summary", "gpt2", "--set", "novalue"])


def test_cli_summary_meta_counts_full_size(capsys):
    assert main(["summary", "vit-base-patch16", "--meta"]) == 0
    out = capsys.readouterr().out
    assert "86,5" in out or "86,6" in out  # ViT-B/16 has ~86.6M parameters


def test_cli_train_saves_model_with_privacy_metadata(tmp_path, capsys):
    pytest.importorskip("sklearn", reason="the digits dataset ships with scikit-learn (test extra)")
    assert main(["train", "resnet18-gn-bias", "--epochs", "1", "--epsilon", "4", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "epoch 1: test accuracy" in out
    meta = dpzoo.privacy_metadata(tmp_path / "model")
    assert meta["epsilon"] <= 4.0 and meta["accountant"] == "rdp" and meta["steps"] > 0
    import json

    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["history"][0]["epsilon"] == pytest.approx(meta["epsilon"])
    assert dpzoo.load(tmp_path / "model").fc.out_features == 10


def test_cli_train_rejects_non_image_models(capsys):
    assert main(["train", "gpt2", "--epochs", "1"]) == 2
    assert "only image, tabular and text classifiers and sequence models" in capsys.readouterr().err


def test_cli_trains_a_sequence_model_on_synthetic_data(tmp_path, capsys):
    """issue 5: a 2-epoch run on synthetic data completes from the CLI, user-level privacy."""
    assert (
        main(
            [
                "train",
                "transformer-seqrec",
                "--data",
                "synthetic",
                "--epochs",
                "2",
                "--eval-every",
                "1",
                "--epsilon",
                "5",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "epoch 2: test NDCG@10" in out
    import json

    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert len(metrics["history"]) == 2 and metrics["history"][-1]["epsilon"] <= 5.0
    assert 0 <= metrics["history"][-1]["test_ndcg@10"] <= metrics["history"][-1]["test_hit@10"] <= 1
    meta = dpzoo.privacy_metadata(tmp_path / "model")
    assert meta["privacy_unit"] == "user" and meta["epsilon"] <= 5.0
    assert (tmp_path / "metrics.png").stat().st_size > 0
    m = dpzoo.load(tmp_path / "model")
    assert m.out.weight is m.item_emb.weight


def test_cli_amazon_columns_reaches_the_loader(tmp_path, capsys):
    """An Amazon CSV whose ids cannot tell the column order is refused unless --amazon-columns says it."""
    rows = [(f"B{u:09d}", f"B{900000000 + i:09d}", 1000 + 10 * u + i) for u in range(7) for i in range(5)]
    path = tmp_path / "games.csv"
    path.write_text("".join(f"{i},{u},5.0,{t}\n" for u, i, t in rows))  # item first, all ids ASIN-shaped
    args = ["train", "gru-seqrec", "--data", str(path), "--epochs", "1", "--eval-every", "1", "--batch-size", "4"]
    assert main(args) == 2
    assert "--amazon-columns" in capsys.readouterr().err
    assert main(args + ["--amazon-columns", "item,user,rating,timestamp"]) == 0
    assert "7 users" in capsys.readouterr().out  # read the other way round: 5 users of 7 items


def test_unregister_model_removes_a_user_entry_and_refuses_dpzoos_own():
    def tiny_user_net(pretrained=False, pretrained_tag=None, weights=None):
        """A user's one-layer net."""
        return torch.nn.Linear(2, 2)

    dpzoo.register_model("test-unregister-net")(tiny_user_net)
    assert dpzoo.is_model("test-unregister-net")
    assert dpzoo.unregister_model("test-unregister-net") is tiny_user_net
    assert not dpzoo.is_model("test-unregister-net") and "test-unregister-net" not in dpzoo.list_models()
    with pytest.raises(dpzoo.UnknownModelError):
        dpzoo.unregister_model("test-unregister-net")
    with pytest.raises(InvalidArgumentError, match="dpzoo's own"):
        dpzoo.unregister_model("resnet18-gn-bias")
    assert dpzoo.is_model("resnet18-gn-bias")


def test_every_card_says_whether_its_pretrained_weights_are_dp_ready():
    """Each tag names its weights' normalisation fate and says DP-ready as it is, or not; an entry
    without tags says so."""
    for name in dpzoo.list_models():
        card = dpzoo.model_card(name)
        section = card.to_markdown().split("## Pretrained tags\n", 1)[1].split("\n## ", 1)[0]
        if not card.pretrained_tags:
            assert section.strip().startswith("None:"), name
        for tag, source in card.pretrained_tags.items():
            assert "DP-ready" in source, (name, tag)
            assert f"`{tag}`" in section, (name, tag)
