"""The command line's contract before a run starts: every mistake is one line on stderr with exit
code 2, --out is checked before the data is read, options that do not apply are refused, and
--help shows every option's default without importing torch. The runs themselves (progress,
metrics, checkpoints, Ctrl-C, --resume): tests/test_cli_runs.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_errors import one_line_error

from dpzoo.cli import build_parser
from dpzoo.cli.choices import BUILTIN_ACCOUNTANTS, BUILTIN_DATASETS, BUILTIN_MODELS, BUILTIN_MODES, DEFAULT_CLI_MODE
from dpzoo.runs.files import prepare_out_dir

ROOT = Path(__file__).resolve().parents[1]
# a tiny sequence run: 500 synthetic users, q = 0.256, 4 steps an epoch
TINY = ["gru-seqrec", "--set", "d_model=8", "--max-len", "8", "--batch-size", "128", "--epochs", "2"]


# -- every mistake: one line, exit code 2 ----------------------------------------------------------
@pytest.mark.parametrize(
    "argv, says",
    [
        (["--epsilon", "0"], "--epsilon: must be > 0"),
        (["--epsilon", "nan"], "finite"),
        (["--delta", "1.5"], "--delta: must be strictly between 0 and 1"),
        (["--delta", "0"], "--delta"),
        (["--delta", "0.5", "--set", "width=4"], "delta = 0.5 is at least 1/N = 1/1438"),
        (["--epochs", "0"], "--epochs: must be at least 1"),
        (["--epochs", "2.5"], "whole number"),
        (["--eval-every", "0"], "--eval-every"),
        (["--lr", "-1"], "--lr: must be > 0"),
        (["--max-grad-norm", "0"], "--max-grad-norm: must be > 0"),
        (["--batch-size", "0"], "--batch-size"),
        (["--max-physical-batch-size", "0"], "--max-physical-batch-size"),
        (["--seed", "-3"], "--seed"),
        (["--set", "width"], "KEY=VALUE"),
        (["--checkpoint-every", "0"], "--checkpoint-every"),
        (["--mode", "fast"], "--mode"),
        (["--mode", "lora"], "--mode lora trains the adapters of a PEFT model"),
        (["--accountant", "gdp"], "--accountant"),
        (["--set", "colour=red"], "does not accept override(s) 'colour'"),
        (["--set", "num_classes=3"], "num_classes"),
        (["--batch-size", "5000"], "larger than the 1438 training images"),
        (["--max-len", "10"], "--max-len is for sequence models"),
        (["--non-private"], "--non-private is for sequence models"),
        (["--amazon-columns", "user,item,rating,timestamp"], "--amazon-columns is for sequence models"),
        (["--data", "synthetic"], "--data synthetic: image classifiers train on digits"),
        (["--device", "banana"], "not a torch device"),
        (["--checkpoint-every", "5"], "--checkpoint-every needs --out"),
        (["--overwrite"], "--overwrite needs --out"),
    ],
)
def test_image_training_mistakes_are_one_line(capsys, argv, says):
    assert says in one_line_error(capsys, ["train", "resnet18-gn-bias", *argv])


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--max-len", "0"], "--max-len: must be at least 1"),
        (["--full-size"], "--full-size is for image classifiers"),
        (["--data", "digits"], "--data digits is for image classifiers"),
        (["--data", "/nonexistent/ratings.txt"], "neither a dataset"),
        (["--non-private", "--epsilon", "3", "--mode", "bk"], "--epsilon, --mode do not apply with --non-private"),
        (["--set", "num_items=3"], "override 'num_items'"),
        (["--batch-size", "5000"], "larger than the 500 users"),
    ],
)
def test_sequence_training_mistakes_are_one_line(capsys, argv, says):
    assert says in one_line_error(capsys, ["train", "dpformer", *argv])


def test_other_mistakes_are_one_line(capsys, tmp_path):
    assert "only image, tabular and text classifiers and sequence models" in one_line_error(capsys, ["train", "gpt2"])
    assert "needs a model NAME" in one_line_error(capsys, ["train"])
    assert "Did you mean: resnet18-gn-bias" in one_line_error(capsys, ["train", "resnet18-gnbias"])
    assert "invalid choice" in one_line_error(capsys, ["trian"])
    assert "No training checkpoint" in one_line_error(capsys, ["train", "--resume", str(tmp_path)])
    (tmp_path / "a-file").write_text("x")
    assert "is a file" in one_line_error(capsys, ["audit", "--out", str(tmp_path / "a-file")])
    assert "--canaries: must be at least 1" in one_line_error(capsys, ["audit", "--canaries", "0"])
    assert "--confidence" in one_line_error(capsys, ["audit", "--confidence", "1"])


def test_datasets_of_one_user_or_unreadable_are_one_line(capsys, tmp_path):
    one_user = tmp_path / "one.txt"
    one_user.write_text("".join(f"1 {i}\n" for i in range(1, 30)))
    assert "1 user(s)" in one_line_error(capsys, ["train", "gru-seqrec", "--data", str(one_user)])
    assert "neither a dataset" in one_line_error(capsys, ["train", "gru-seqrec", "--data", str(tmp_path)])


@pytest.mark.slow
def test_a_real_process_prints_one_line_and_exits_2(tmp_path):
    argv = [sys.executable, "-m", "dpzoo", "train", "resnet18-gn-bias", "--epsilon", "0"]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "dpzoo: error: argument --epsilon: must be > 0, got 0 (`dpzoo train --help` lists the options)"
    ]


# -- --out is checked before training ----------------------------------------------------------------
def test_out_is_checked_before_the_data_is_even_read(capsys, tmp_path, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the data was read: --out was not checked first")

    monkeypatch.setattr("dpzoo.seqrec.train.get_dataset", never)
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "metrics.csv").write_text("epoch\n1\n")
    says = one_line_error(capsys, ["train", *TINY, "--out", str(tmp_path)])
    assert "is not empty" in says and "--overwrite" in says
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.csv", "notes.txt"]  # untouched
    assert prepare_out_dir(tmp_path, overwrite=True) == tmp_path  # --overwrite removes dpzoo's results only
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    (tmp_path / "checkpoint.pt").write_text("x")  # a checkpointed run is pointed to --resume
    assert "--resume" in one_line_error(capsys, ["train", *TINY, "--out", str(tmp_path)])
    blocker = tmp_path / "notes.txt"
    assert "cannot be written" in one_line_error(capsys, ["train", *TINY, "--out", str(blocker / "run")])


# -- --help: a sentence and a default for every option; no torch to build it --------------------------
def subcommands():
    return build_parser()._subparsers._group_actions[0].choices


def test_every_option_has_a_sentence_and_its_default():
    subs = subcommands()
    for cmd, parser in subs.items():
        for action in parser._actions:
            if not action.option_strings or action.dest == "help":
                continue
            text = action.help or ""
            assert len(text.split()) >= 3, f"dpzoo {cmd} {action.option_strings[0]}: no sentence"
            says_default = "default" in text or action.required
            assert says_default, f"dpzoo {cmd} {action.option_strings[0]}: its default is not shown: {text!r}"


def test_train_help_lists_the_registries():
    subs = subcommands()
    text = " ".join(subs["train"].format_help().split())
    for name, task in BUILTIN_MODELS.items():
        assert (name in text) == (
            task
            in (
                "image-classification",
                "tabular-classification",
                "sequence-classification",
                "sequential-recommendation",
            )
        ), name
    for name in [*BUILTIN_MODES, *BUILTIN_ACCOUNTANTS, *BUILTIN_DATASETS, "synthetic", "digits"]:
        assert name in text
    assert "(default: 8)" in text and "(default: bk-mixopt)" in text


_REGISTRIES = """
import json
from dpzoo.privacy.accounting.registry import ACCOUNTANTS, accountant_spec
from dpzoo.privacy.modes import DEFAULT_CLI_MODE, TRAINING_MODES
from dpzoo.models import list_models, model_card
from dpzoo.seqrec.downloads import DATASETS
print(json.dumps({
    "models": {n: model_card(n).task for n in list_models()},
    "accountants": [a for a in ACCOUNTANTS if accountant_spec(a).upper_bound],
    "modes": {m.name: m.description for m in TRAINING_MODES.values()},
    "default_mode": DEFAULT_CLI_MODE,
    "datasets": {d.name: [d.description, d.max_len] for d in DATASETS.values()},
}))
"""


@pytest.mark.slow
def test_the_built_in_choices_are_the_registries():
    """--help lists these without importing the registries (which import torch): they must be
    exactly what a fresh process registers."""
    done = subprocess.run([sys.executable, "-c", _REGISTRIES], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    live = json.loads(done.stdout)
    assert live["models"] == BUILTIN_MODELS
    assert live["accountants"] == list(BUILTIN_ACCOUNTANTS)
    assert live["modes"] == BUILTIN_MODES and live["default_mode"] == DEFAULT_CLI_MODE
    assert live["datasets"] == {k: list(v) for k, v in BUILTIN_DATASETS.items()}


def test_help_imports_no_torch_and_answers_at_once():
    code = (
        "import sys, dpzoo.cli\n"
        "p = dpzoo.cli.build_parser()\n"
        "for cmd in ('train', 'audit', 'summary', 'prepare', 'list', 'card', 'cards'):\n"
        "    p._subparsers._group_actions[0].choices[cmd].format_help()\n"
        "print(sorted(m for m in ('torch', 'timm', 'transformers', 'dp_accounting') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"building the parser imported {done.stdout.strip()}"
    started = time.time()
    done = subprocess.run([sys.executable, "-m", "dpzoo", "train", "--help"], capture_output=True, cwd=ROOT)
    assert done.returncode == 0 and time.time() - started < 1.5
