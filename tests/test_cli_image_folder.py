"""Your own images from the CLI: `dpzoo train NAME --data IMAGE_FOLDER`, `dpzoo eval RUN`, and
`dpzoo.load(RUN)` on the --out directory (issue: a newcomer's first hour)."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

import dpzoo
from dpzoo.cli import main
from dpzoo.errors import CheckpointError

TRAIN = ["train", "cnn-tanh-gn", "--epochs", "1", "--batch-size", "8", "--quiet"]


def _folder(root, classes=("ant", "bee", "cat"), per_class=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    for k, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = (torch.rand(10, 12, 3, generator=g) * 80 + 60 * k).clamp(0, 255).to(torch.uint8)
            Image.fromarray(pixels.numpy()).save(root / name / f"{i}.png")
    return root


def test_train_eval_and_load_on_an_image_folder(tmp_path, capsys):
    data, out = _folder(tmp_path / "images"), tmp_path / "run"
    assert main([*TRAIN, "--data", str(data), "--out", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["classes"] == ["ant", "bee", "cat"] and metrics["image_size"] == 32
    model = dpzoo.load(out)  # the --out directory, not only its model/
    assert model(torch.zeros(1, 3, 32, 32)).shape == (1, 3)
    assert model.dpzoo_privacy["epsilon"] == pytest.approx(metrics["epsilon"])
    capsys.readouterr()
    assert main(["eval", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["images"] == 6 and 0.0 <= result["test_accuracy"] <= 1.0  # the held-out 20% of 30
    assert main(["eval", str(out), "--data", str(data / ".." / "images"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["images"] == 6  # the same folder: the run's own test split


def test_a_train_and_val_layout_is_used_as_its_split(tmp_path, capsys):
    root = tmp_path / "images"
    _folder(root / "train", classes=("a", "b"), per_class=8)
    _folder(root / "val", classes=("a", "b"), per_class=3, seed=1)
    out = tmp_path / "run"
    assert main([*TRAIN, "--data", str(root), "--image-size", "16", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["eval", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["images"] == 6


@pytest.mark.parametrize(
    "layout, message",
    [
        ("missing", "image classifiers train on digits or an image folder"),
        ("one-class", "a classifier needs at least 2"),
        ("no-images", "not an image folder"),
        ("train-without-val", "no val/ or test/"),
    ],
)
def test_a_wrong_image_folder_is_one_line(tmp_path, capsys, layout, message):
    root = tmp_path / "images"
    if layout == "one-class":
        _folder(root, classes=("only",))
    elif layout == "no-images":
        (root / "a").mkdir(parents=True)
        (root / "b").mkdir()
    elif layout == "train-without-val":
        _folder(root / "train", classes=("a", "b"))
    assert main([*TRAIN, "--data", str(root), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dpzoo: error: ") and message in err and "\n" not in err
    assert not (tmp_path / "run").exists()  # refused before anything was written: no empty --out left


def test_eval_refuses_data_with_other_classes(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*TRAIN, "--data", str(_folder(tmp_path / "images")), "--out", str(out)]) == 0
    other = _folder(tmp_path / "other", classes=("x", "y", "z"))
    assert main(["eval", str(out), "--data", str(other)]) == 2
    assert "the run was trained on ['ant', 'bee', 'cat']" in capsys.readouterr().err


def test_load_says_when_a_run_has_no_model_yet(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.csv").write_text("epoch,test_accuracy\n")
    with pytest.raises(CheckpointError, match="did not finish.*--resume"):
        dpzoo.load(run)
