"""``dpzoo train --config FILE``: a YAML or JSON file of the train options, as timm's train.py takes
them; the command line wins, every value is checked as its option checks it, and a mistake is one
line (dpzoo/cli/config.py)."""

from __future__ import annotations

import json

import pytest
from cli_errors import one_line_error

from dpzoo.cli import main


def _done(kw):
    return {"model": kw["name"], "steps": 1, "epsilon": 1.0, "delta": 1e-5, "history": [{"test_accuracy": 0.5}]}


@pytest.fixture
def trainer(monkeypatch):
    seen = {}
    monkeypatch.setattr("dpzoo.runs.classifier.train_image_classifier", lambda **kw: seen.update(kw) or _done(kw))
    return seen


@pytest.mark.parametrize("suffix", ["yaml", "json"])
def test_a_config_file_gives_the_options_and_the_command_line_wins(tmp_path, trainer, suffix):
    config = {"model": "resnet18-gn-bias", "epochs": 3, "lr": "1e-2", "max_grad_norm": 0.5, "set": {"width": 16},
              "schedule": "cosine", "quiet": True}  # fmt: skip
    path = tmp_path / f"run.{suffix}"
    text = json.dumps(config) if suffix == "json" else "\n".join(f"{k}: {json.dumps(v)}" for k, v in config.items())
    path.write_text(text.replace('"1e-2"', "1e-2"))  # YAML reads 1e-2 as a string: the option converts it
    assert main(["train", "--config", str(path), "--epochs", "5"]) == 0
    assert trainer["name"] == "resnet18-gn-bias" and trainer["epochs"] == 5  # the command line wins
    assert (trainer["lr"], trainer["max_grad_norm"], trainer["schedule"]) == (1e-2, 0.5, "cosine")
    assert trainer["overrides"] == {"width": 16} and trainer["progress"] is False


@pytest.mark.parametrize(
    "content, reason",
    [
        ("epochs: 3\nepoch: 4\n", "unknown option 'epoch'"),
        ("epochs: -1\n", "argument --epochs"),
        ("- epochs\n- 3\n", "must hold a mapping"),
        ("epochs: [3\n", "not valid YAML"),
        ("quiet: 3\n", "quiet is a switch"),
        ("max-len: 50\n", "--max-len is for sequence models"),
    ],
)
def test_a_wrong_config_is_one_line(tmp_path, capsys, trainer, content, reason):
    path = tmp_path / "run.yaml"
    path.write_text(content)
    assert reason in one_line_error(capsys, ["train", "cnn-tanh-gn", "--config", str(path)])


def test_a_missing_config_and_a_resume_that_would_change_settings_are_one_line(tmp_path, capsys):
    assert "cannot be read" in one_line_error(capsys, ["train", "cnn-tanh-gn", "--config", str(tmp_path / "no.yaml")])
    path = tmp_path / "run.yaml"
    path.write_text("epochs: 9\n")
    line = one_line_error(capsys, ["train", "--resume", str(tmp_path), "--config", str(path)])
    assert "--resume continues the run with the settings it started with: drop --epochs" in line
