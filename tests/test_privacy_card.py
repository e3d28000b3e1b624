"""The privacy card: every saved private model carries README.md with a privacy block that
validates against docs/privacy_card.schema.json and a plain-language statement whose numbers
recompute from the record; a hand-edited card is refused on load; `dpzoo card DIR` prints it."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import dpzoo
from dpzoo.cli import main
from dpzoo.privacy_card import membership_tpr_bound, read_card

SCHEMA = json.loads((Path(__file__).parents[1] / "docs" / "privacy_card.schema.json").read_text())


def _trained(tmp_path, epsilon=3.0):
    """A small model trained two steps by dpzoo's engine and saved: (directory, engine)."""
    torch.manual_seed(0)
    model = dpzoo.load("mlp-tanh", in_features=4, num_classes=2, width=8)
    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    engine = dpzoo.PrivacyEngine()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = engine.make_private(module=model, optimizer=opt, data_loader=DataLoader(data, batch_size=8),
                                                 target_epsilon=epsilon, target_delta=1e-3, epochs=1)  # fmt: skip
        for x, y in loader:
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return dpzoo.save(model, tmp_path / "model", privacy=engine.privacy_metadata(1e-3)), engine


def test_the_card_validates_against_the_schema_and_states_the_engines_numbers(tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    directory, engine = _trained(tmp_path)
    front = read_card(directory)
    jsonschema.validate(front, SCHEMA)
    block = front["privacy"]
    assert block["epsilon"] == pytest.approx(engine.get_epsilon(1e-3), rel=1e-12)
    assert block["unit_of_privacy"] == "example" and block["clipping"] == "abadi"
    assert block["accounting"]["library"] == "dp-accounting" and block["history"] == [
        list(h) for h in engine.accountant.history
    ]
    statement = dpzoo.privacy_statement(directory)
    assert f"ε = {block['epsilon']:.3g}" in statement and f"{block['steps']} steps" in statement
    tpr = membership_tpr_bound(block["epsilon"], 1e-3)
    assert f"{tpr:.1%}" in statement
    assert statement == dpzoo.privacy_statement(dpzoo.load(directory))  # the loaded model says the same


def test_a_pretrained_start_is_the_cards_base_model():
    jsonschema = pytest.importorskip("jsonschema")
    import yaml

    from dpzoo.privacy_card import render_card

    text = render_card("bert-base", None, base_model="google-bert/bert-base-uncased")
    front = yaml.safe_load(text.split("---\n")[1])
    jsonschema.validate(front, SCHEMA)
    assert front["base_model"] == "google-bert/bert-base-uncased" and "privacy" not in front


def test_membership_bound_is_the_hypothesis_testing_region_of_eps_delta():
    # e^ε·α + δ binds at small ε, 1 - e^-ε(1 - δ - α) at large ε; no DP: anything
    assert membership_tpr_bound(1.0, 1e-5, 0.01) == pytest.approx(math.e * 0.01 + 1e-5)
    assert membership_tpr_bound(8.0, 1e-5, 0.01) == pytest.approx(1 - math.exp(-8) * (1 - 1e-5 - 0.01))
    assert membership_tpr_bound(math.inf, 1e-5) == 1.0
    for eps in (0.1, 0.5, 2.0, 5.0):  # the region is symmetric: (α, 1 - TPR) obeys the same inequality
        t = membership_tpr_bound(eps, 1e-6, 0.05)
        assert 1 - t >= math.exp(-eps) * (1 - 1e-6 - 0.05) - 1e-12 and t <= math.exp(eps) * 0.05 + 1e-6 + 1e-12


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.replace("steps: 4", "steps: 40"), "says steps = 40"),
        (lambda t: _set_epsilon(t, 0.5), "says epsilon = 0.5"),
        (lambda t: t.replace("  - - ", "  - - 9", 1), "says history"),
        (lambda t: t[: t.index("privacy:")] + "---\n", "states no privacy guarantee"),
        (lambda t: "\ufeff" + _set_epsilon(t, 0.5), "says epsilon = 0.5"),  # a byte-order mark
        (lambda t: _set_epsilon(t, 0.5).replace("\n", "\r\n"), "says epsilon = 0.5"),  # Windows line endings
        (lambda t: t[t.index("\n---\n", 3) + 5 :], "states no privacy guarantee"),  # front matter removed
        (lambda t: t.replace("unit_of_privacy: example", "unit_of_privacy: user"), "says unit_of_privacy"),
        (lambda t: t.replace("trust_model: 'central", "trust_model: 'local"), "says trust_model"),
        (lambda t: t.replace("public_statistics: none recorded", "public_statistics: none"), "says public_statistics"),
        (lambda t: t.replace("  accountant: rdp\n  steps", "  accountant: rdp\n  extra: 1\n  steps"), "says extra"),
        (lambda t: t.replace("What is protected: one training example", "What is protected: everything"), "its text"),
    ],
)
def test_a_hand_edited_card_is_refused_on_load(tmp_path, edit, message):
    directory, _ = _trained(tmp_path)
    card = directory / "README.md"
    card.write_bytes(edit(card.read_text()).encode("utf-8"))
    with pytest.raises(dpzoo.DPZooError, match=message):
        dpzoo.load(directory)


def test_the_statement_says_when_there_is_no_guarantee_or_a_seed_breaks_it():
    from dpzoo.privacy_card import statement_from_record

    base = {
        "epsilon": 2.0,
        "delta": 1e-5,
        "accountant": "rdp",
        "steps": 10,
        "sample_rate": 0.1,
        "noise_multiplier": 1.0,
    }
    none = statement_from_record({**base, "epsilon": math.inf})
    assert none.startswith("Trained by dpzoo") and "NO differential-privacy guarantee" in none
    assert "What is protected" not in none and "Against whom" not in none
    seeded = statement_from_record({**base, "noise": "reproducible (not private against anyone holding the seed)"})
    assert "NOT against anyone who holds the noise seed" in seeded
    composed = statement_from_record({**base, "history": [[5.0, 1.0, 1], [1.0, 0.1, 10]]})
    assert "over 2 composed releases (11 steps in all" in composed and "q = 0.1 and" not in composed
    failed = statement_from_record({**base, "self_check": "failed: a difference of 3e-1"})
    assert "the stated ε may not hold" in failed


def _set_epsilon(text, value):
    lines = [f"  epsilon: {value}" if line.startswith("  epsilon:") else line for line in text.splitlines()]
    return "\n".join(lines) + "\n"


def test_a_card_claiming_privacy_for_a_model_without_a_record_is_refused(tmp_path):
    directory, _ = _trained(tmp_path)
    plain = dpzoo.save(dpzoo.load("mlp-tanh", in_features=4, num_classes=2, width=8), tmp_path / "plain")
    assert "datasets" not in read_card(plain)
    assert "No differential-privacy guarantee" in (plain / "README.md").read_text()
    assert read_card(plain).get("privacy") is None and dpzoo.load(plain) is not None
    (plain / "README.md").write_text((directory / "README.md").read_text())
    with pytest.raises(dpzoo.DPZooError, match="does not hold"):
        dpzoo.load(plain)


def test_cli_card_prints_the_statement_of_a_run(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "mlp-tanh", "--epochs", "1", "--quiet", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["card", str(out)]) == 0
    text = capsys.readouterr().out
    meta = json.loads((out / "metrics.json").read_text())
    assert read_card(out / "model")["datasets"] == ["digits"]
    assert text.startswith("Trained with differential privacy") and f"ε = {meta['epsilon']:.3g}" in text
    assert (out / "model" / "README.md").is_file()


def test_a_hugging_face_directory_gets_the_card_and_an_edit_is_caught(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    from dpzoo.integrations.trainer_save import read_privacy_metadata, write_privacy_files

    directory, engine = _trained(tmp_path)
    record = dpzoo.privacy_metadata(directory)
    hf = BertForSequenceClassification(BertConfig(vocab_size=16, hidden_size=8, num_hidden_layers=1,
                                                  num_attention_heads=2, intermediate_size=8))  # fmt: skip
    hf.save_pretrained(tmp_path / "hf")
    write_privacy_files(hf, tmp_path / "hf", record)
    assert read_card(tmp_path / "hf")["privacy"]["epsilon"] == pytest.approx(record["epsilon"])
    assert read_privacy_metadata(tmp_path / "hf")["steps"] == record["steps"]
    card = tmp_path / "hf" / "README.md"
    card.write_text(_set_epsilon(card.read_text(), 0.1))
    with pytest.raises(dpzoo.DPZooError, match="says epsilon = 0.1"):
        read_privacy_metadata(tmp_path / "hf")
    write_privacy_files(hf, tmp_path / "hf", None)  # a save without a record removes our card
    assert not card.exists()
