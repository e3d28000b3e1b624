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
from dpzoo.hub.privacy_card import membership_tpr_bound, read_card

SCHEMA = json.loads((Path(__file__).parents[1] / "docs" / "privacy_card.schema.json").read_text())


def _trained(tmp_path, epsilon=3.0, n=32, batch_size=8, epochs=1, delta=1e-3):
    """A small model trained by dpzoo's engine (n / batch_size steps per epoch) and saved: (directory, engine)."""
    torch.manual_seed(0)
    model = dpzoo.load("mlp-tanh", in_features=4, num_classes=2, width=8)
    data = TensorDataset(torch.randn(n, 4), torch.randint(0, 2, (n,)))
    engine = dpzoo.PrivacyEngine()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = engine.make_private(module=model, optimizer=opt, data_loader=DataLoader(data, batch_size=batch_size),
                                                 target_epsilon=epsilon, target_delta=delta, epochs=epochs)  # fmt: skip
        for _, (x, y) in zip(range(epochs * len(loader)), (b for _ in range(epochs) for b in loader)):
            if len(y):
                torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return dpzoo.save(model, tmp_path / "model", privacy=engine.privacy_metadata(delta)), engine


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

    from dpzoo.hub.privacy_card import render_card

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
    from dpzoo.hub.privacy_card import statement_from_record

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


def _audited(tmp_path, capsys, *extra):
    """A model trained 80 steps at ε = 8 (q = 1/16), then `dpzoo audit --run` on it. At ε = 8 the 2R
    control exceeds the claim by a margin the audit's noise cannot close (measured 10.5-11.7 against
    8, the audit 2.4-2.8); at ε = 2 it was 2.2-2.9 against 1.99, too close for a test."""
    directory, engine = _trained(tmp_path, epsilon=8.0, n=512, batch_size=32, epochs=5, delta=1e-5)
    code = main(["audit", "--run", str(directory), "--quiet", *extra])
    return directory, engine, code, capsys.readouterr().out


def test_an_audit_of_the_models_mechanism_is_recorded_in_its_card(tmp_path, capsys):
    """`dpzoo audit --run DIR` audits the saved record's σ, R, clipping and steps white-box on the
    canary task (with its 2R control), and the card states the result; the loaded model keeps it."""
    jsonschema = pytest.importorskip("jsonschema")
    directory, engine, code, out = _audited(tmp_path, capsys, "--with-controls")
    assert code == 0 and "recorded in" in out
    front = read_card(directory)
    jsonschema.validate(front, SCHEMA)
    audit = front["privacy"]["audit"]
    assert audit["mechanism"]["noise_multiplier"] == pytest.approx(engine.noise_multiplier, rel=1e-12)
    assert audit["mechanism"]["steps"] == engine.steps == 80 and audit["canaries"] == 2500
    assert audit["epsilon_lower_bound"] < audit["claimed_epsilon"] and not audit["exceeds"]
    assert audit["control_sensitivity_2x"]["caught"]
    statement = dpzoo.privacy_statement(directory)
    assert f"found ε ≥ {audit['epsilon_lower_bound']:.3g}" in statement and "would catch such a bug" in statement
    dpzoo.load(directory)  # the card's audit agrees with dpzoo_audit.json and the record


def test_an_audit_too_weak_to_catch_a_doubled_clip_says_so(tmp_path, capsys):
    """4 steps at q = 1/4 with 500 canaries: the 2R control stays below the claim, so the audit
    cannot vouch: exit 3, and the card says so instead of implying a check it did not make."""
    directory, _ = _trained(tmp_path, epsilon=2.0)
    assert main(["audit", "--run", str(directory), "--quiet", "--canaries", "500", "--with-controls"]) == 3
    assert not read_card(directory)["privacy"]["audit"]["control_sensitivity_2x"]["caught"]
    assert "could NOT catch such a bug at these settings" in dpzoo.privacy_statement(directory)


def test_a_recorded_audit_sees_a_doubled_clip(tmp_path, capsys, monkeypatch):
    """The audit runs dpzoo's own optimizer: with every clip factor doubled (the 2R bug) it finds
    ε above the claim, exits 1, and the card says the implementation leaked more than it claims."""
    from dpzoo.privacy.optimizer import DPOptimizer

    original = DPOptimizer.clip_factors
    directory, _ = _trained(tmp_path, epsilon=8.0, n=512, batch_size=32, epochs=5, delta=1e-5)
    monkeypatch.setattr(DPOptimizer, "clip_factors", lambda self, norms: 2 * original(self, norms))
    assert main(["audit", "--run", str(directory), "--quiet"]) == 1
    assert read_card(directory)["privacy"]["audit"]["exceeds"]
    assert "ABOVE the ε" in dpzoo.privacy_statement(directory)


def _json_edit(directory, change):
    path = directory / "dpzoo_audit.json"
    saved = json.loads(path.read_text())
    change(saved)
    path.write_text(json.dumps(saved))


def _bump_an_out_score(saved):
    result = saved["result"]
    outs = [i for i, member in enumerate(result["membership"]) if not member]
    for i in outs[: len(outs) // 2]:
        result["scores"][i] += 1e3  # half the out-canaries scored above every in-canary: the bound moves


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: _edit(d / "README.md", "epsilon_lower_bound: ", "epsilon_lower_bound: 0.0"), "audit block is not"),
        (lambda d: (d / "dpzoo_audit.json").unlink(), "does not hold"),
        (lambda d: _edit(d / "README.md", "    caught: true", "    caught: false"), "audit block is not"),
        (lambda d: _json_edit(d, _bump_an_out_score), "audit block is not"),
        (lambda d: _json_edit(d, lambda s: s["result"]["mechanism"].update(threat_model="black-box: the final model")),
         "not an audit of this model's mechanism"),
        (lambda d: _json_edit(d, lambda s: s["control"]["mechanism"].update(steps=1)), "not an audit of this model's mechanism"),
        (lambda d: _json_edit(d, lambda s: s["run"].update(noise_multiplier=9.0)), "not an audit of this model's mechanism"),
    ],
)  # fmt: skip
def test_a_hand_edited_audit_is_refused_on_load(tmp_path, capsys, edit, message):
    directory, *_ = _audited(tmp_path, capsys, "--with-controls")
    edit(directory)
    with pytest.raises(dpzoo.DPZooError, match=message):
        dpzoo.load(directory)


def test_the_audits_derived_numbers_are_recomputed_from_its_scores(tmp_path, capsys):
    """The block is rebuilt from the canaries' scores: a file whose stated bound or verdict was
    edited (but not its evidence) still gives the card the true numbers."""
    directory, *_ = _audited(tmp_path, capsys, "--with-controls")
    before = read_card(directory)["privacy"]["audit"]
    _json_edit(directory, lambda s: s["result"].update(epsilon_lower_bound=99.0, exceeds=True))
    _json_edit(directory, lambda s: s["control"].update(epsilon_lower_bound=0.0, exceeds=False))
    dpzoo.load(directory)
    assert read_card(directory)["privacy"]["audit"] == before


def test_an_audit_of_another_model_is_refused(tmp_path, capsys):
    """Model A's audit (file and block) put beside model B, whose σ, q and steps differ; and A's
    result handed to record_audit for B."""
    from dpzoo.audit import record_audit
    from dpzoo.hub.privacy_card import render_card

    a, *_ = _audited(tmp_path / "a", capsys)
    b, _ = _trained(tmp_path / "b", epsilon=4.0, n=512, batch_size=64, epochs=2, delta=1e-5)
    (b / "dpzoo_audit.json").write_text((a / "dpzoo_audit.json").read_text())
    record_b = dpzoo.privacy_metadata(b)
    (b / "README.md").write_text(render_card("mlp-tanh", record_b, audit=read_card(a)["privacy"]["audit"]))
    with pytest.raises(dpzoo.DPZooError, match="not an audit of this model's mechanism"):
        dpzoo.load(b)
    from dpzoo.audit import audit_record

    result_a = audit_record(dpzoo.privacy_metadata(a), canaries=200, progress=False)
    c, _ = _trained(tmp_path / "c", epsilon=4.0, n=512, batch_size=64, epochs=2, delta=1e-5)
    with pytest.raises(dpzoo.DPZooError, match="not the white-box audit of"):
        record_audit(c, result_a)


def test_an_audit_sentence_without_an_audit_block_is_refused(tmp_path, capsys):
    audited, *_ = _audited(tmp_path / "a", capsys)
    plain, _ = _trained(tmp_path / "b")
    sentence = next(line for line in dpzoo.privacy_statement(audited).splitlines() if line.startswith("Audited: "))
    (plain / "README.md").write_text((plain / "README.md").read_text() + "\n" + sentence + "\n")
    with pytest.raises(dpzoo.DPZooError, match="states an audit its audit block does not hold"):
        dpzoo.load(plain)


def test_a_vacuous_audit_says_it_could_not_refute_the_claim(tmp_path, capsys):
    directory, _ = _trained(tmp_path, epsilon=8.0, n=512, batch_size=32, epochs=5, delta=1e-5)
    assert main(["audit", "--run", str(directory), "--quiet", "--canaries", "20"]) == 3
    assert "could not have refuted the claim" in dpzoo.privacy_statement(directory)


def _edit(path, start, replacement):
    lines = path.read_text().splitlines(keepends=True)
    i = next(i for i, line in enumerate(lines) if line.strip().startswith(start.strip()))
    indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
    lines[i] = indent + replacement.strip() + "\n"
    path.write_text("".join(lines))


def test_audit_run_refusals(tmp_path, capsys):
    directory, _ = _trained(tmp_path)
    assert main(["audit", "--run", str(directory), "--epsilon", "3"]) == 2
    assert "drop --epsilon" in capsys.readouterr().err
    plain = dpzoo.save(dpzoo.load("mlp-tanh", in_features=4, num_classes=2, width=8), tmp_path / "plain")
    assert main(["audit", "--run", str(plain)]) == 2
    assert "holds no privacy record" in capsys.readouterr().err


def test_a_new_audit_replaces_a_stale_one(tmp_path, capsys):
    """An edited audit block is refused on load, and `dpzoo audit --run` is what the error says to
    run: it must work on that directory and leave a card that loads."""
    directory, *_ = _audited(tmp_path, capsys)
    _edit(directory / "README.md", "epsilon_lower_bound: ", "epsilon_lower_bound: 0.0")
    with pytest.raises(dpzoo.DPZooError, match="rerun `dpzoo audit --run`"):
        dpzoo.load(directory)
    assert main(["audit", "--run", str(directory), "--quiet"]) == 0
    dpzoo.load(directory)


# The Differential Privacy Deployments Registry's record layout (its template's field paths and
# the enumerations dpzoo fills), written from opendp/deployments-registry-data at commit 057e5d8.
REGISTRY_REQUIRED = {
    "deployment.basic": ["name", "data_curators", "description", "intended_use", "data_product_type",
                         "data_product_region", "publication_date"],
    "deployment.dp_variant": ["variant_name", "data_domain", "unprotected_quantities"],
    "deployment.privacy_loss": ["privacy_unit", "privacy_unit_details", "privacy_parameters", "privacy_parameters_details"],
    "deployment.deployment_model": ["model_name", "model_name_details", "trust_assumptions", "actors", "release_type",
                                    "data_source_type", "access_type"],
    "deployment.implementation": ["preprocessing_and_hyperparameter_tuning", "mechanisms", "composition",
                                  "post_processing", "justification", "additional_information"],
    "deployment.administrative": ["status", "registry_authors", "tier"],
}  # fmt: skip
REGISTRY_ENUMS = {
    "deployment.basic.data_product_type": {"Summary statistics", "Machine learning model", "Dataset"},
    "deployment.dp_variant.variant_name": {"Pure DP", "Approximate DP", "Zero-concentrated DP", "Renyi DP", "Custom"},
    "deployment.deployment_model.model_name": {"Local", "Central", "Shuffle", "Federated"},
    "deployment.deployment_model.release_type": {"One release", "Many releases"},
    "deployment.deployment_model.data_source_type": {"Static", "Dynamic"},
    "deployment.deployment_model.access_type": {"Interactive", "Non-interactive"},
    "deployment.administrative.status": {"Draft"},
}


def _at(tree, dotted):
    for key in dotted.split("."):
        tree = tree[key]
    return tree


def test_the_registry_record_has_the_registrys_fields_and_the_models_numbers(tmp_path, capsys):
    import yaml

    directory, engine, *_ = _audited(tmp_path, capsys)
    assert main(["card", str(directory.parent), "--registry"]) == 0  # a run directory works too
    entry = yaml.safe_load(capsys.readouterr().out)
    for parent, keys in REGISTRY_REQUIRED.items():
        assert set(keys) <= set(_at(entry, parent)), parent
    for path, allowed in REGISTRY_ENUMS.items():
        assert _at(entry, path) in allowed, path
    loss = entry["deployment"]["privacy_loss"]
    assert loss["privacy_parameters"] == {"epsilon": pytest.approx(engine.get_epsilon(1e-5), rel=1e-12), "delta": 1e-5}
    assert loss["privacy_unit"] == "Example-level"
    assert "empirical audit" in entry["deployment"]["implementation"]["justification"]
    assert str(engine.steps) in loss["privacy_parameters_details"]
    plain = dpzoo.save(dpzoo.load("mlp-tanh", in_features=4, num_classes=2, width=8), tmp_path / "plain")
    assert main(["card", str(plain), "--registry"]) == 2
    assert "nothing to register" in capsys.readouterr().err


def test_the_registry_record_describes_composed_releases_and_per_example_clipping():
    from dpzoo.hub.deployments_registry import registry_record
    from dpzoo.privacy.accounting.accountant import Accountant

    history = [[0.6, 0.25, 4, 2], [2.0, 0.125, 8, 2]]  # user-level DP by example-level sampling, k = 2
    record = {
        "epsilon": Accountant("pld", history).get_epsilon(1e-5),
        "delta": 1e-5,
        "accountant": "pld",
        "steps": 12,
        "sample_rate": 0.125,
        "noise_multiplier": 2.0,
        "max_grad_norm": 1.0,
        "privacy_unit": "user",
        "users": 16,
        "max_examples_per_user": 2,
        "history": history,
    }
    d = registry_record(record, "mlp-tanh")["deployment"]
    details = d["privacy_loss"]["privacy_parameters_details"]
    assert "σ = 0.6, q = 0.25, 4 steps, k = 2" in details and "σ = 2, q = 0.125, 8 steps, k = 2" in details
    assert d["deployment_model"]["release_type"] == "Many releases"
    assert "per-example clipped" in d["implementation"]["mechanisms"]
    assert "number of users N" in d["dp_variant"]["unprotected_quantities"]
    assert d["privacy_loss"]["number_of_privacy_units"] == 16


def test_a_control_that_is_not_the_same_audit_is_refused(tmp_path, capsys):
    """The sixth audit: a 5,000-canary control beside a 500-canary audit was stated as "the same
    audit" catching a 2R bug the real one could not."""
    from dpzoo.audit import audit_record, record_audit

    directory, _ = _trained(tmp_path, epsilon=2.0, n=512, batch_size=32, epochs=5, delta=1e-5)
    record = dpzoo.privacy_metadata(directory)
    small = audit_record(record, canaries=500, progress=False)
    large_control = audit_record(record, canaries=1000, broken="sensitivity-2x", progress=False)
    with pytest.raises(dpzoo.DPZooError, match="not the same audit with the clip doubled"):
        record_audit(directory, small, large_control)


@pytest.mark.parametrize(
    "spelling",
    [
        "Audited:\nsomething",
        "audited: it passed",
        "AUDITED :  yes",
        "Audited\u200b: yes",
        "Audited\uff1a yes",
        "Audited \u2014 yes",
    ],
)
def test_any_spelling_of_an_audit_sentence_without_a_block_is_refused(tmp_path, spelling):
    plain, _ = _trained(tmp_path)
    (plain / "README.md").write_text((plain / "README.md").read_text() + "\n" + spelling + "\n")
    with pytest.raises(dpzoo.DPZooError, match="states an audit its audit block does not hold"):
        dpzoo.load(plain)


def test_an_edited_version_does_not_switch_the_statement_check_off(tmp_path):
    directory, _ = _trained(tmp_path)
    card = directory / "README.md"
    text = card.read_text().replace("version: 0.1.0", "version: 0.0.9").replace("by dpzoo 0.1.0", "by dpzoo 0.0.9")
    card.write_text(_set_epsilon(text, 0.1).replace("(ε = 3", "(ε = 0.1"))
    with pytest.raises(dpzoo.DPZooError, match="says epsilon|its text"):
        dpzoo.load(directory)
    card.write_text(text.replace("What is protected: one training example", "What is protected: everything"))
    with pytest.raises(dpzoo.DPZooError, match="its text does not state"):
        dpzoo.load(directory)
    card.write_text(text.replace("dpzoo_card_version: 1", "dpzoo_card_version: 0"))
    with pytest.raises(dpzoo.DPZooError, match="dpzoo_card_version 0"):
        dpzoo.load(directory)
