"""The README's main job, `dpzoo train cnn-tanh-gn`, learns: the card's recipe reaches ≥ 90% test
accuracy on the digits at ε = 8 (5 secret-noise runs: 94.4-94.7%, benchmarks/results/main_job).
Seeded here so the outcome is fixed; a broken recipe, model or engine drops far below."""

from __future__ import annotations

import math

import pytest
import torch

import dpzoo
from dpzoo.cli import main
from dpzoo.runs.classifier import train_image_classifier


def test_the_main_job_recipe_reaches_90_percent_at_epsilon_8():
    recipe = dpzoo.model_card("cnn-tanh-gn").train_defaults
    assert recipe == {"epochs": 30, "batch_size": 256, "lr": 1e-2}
    result = train_image_classifier(
        "cnn-tanh-gn", **recipe, noise_seed=3, sample_seed=4, log=lambda m: None, progress=False
    )
    assert result["epsilon"] <= 8.0 and result["history"][-1]["test_accuracy"] >= 0.90


def test_the_cli_uses_the_cards_recipe_unless_told_otherwise(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr("dpzoo.runs.classifier.train_image_classifier", lambda **kw: seen.update(kw) or _done(kw))
    assert main(["train", "cnn-tanh-gn", "--quiet"]) == 0
    assert (seen["epochs"], seen["batch_size"], seen["lr"]) == (30, 256, 1e-2)
    assert main(["train", "cnn-tanh-gn", "--epochs", "3", "--quiet"]) == 0
    assert (seen["epochs"], seen["batch_size"]) == (3, 256)
    assert main(["train", "resnet18-gn-bias", "--quiet"]) == 0
    assert (seen["epochs"], seen["batch_size"], seen["lr"]) == (10, 64, 2e-3)  # no recipe: the image defaults


def _done(kw):
    return {"model": kw["name"], "steps": 1, "epsilon": 1.0, "delta": 1e-5, "history": [{"test_accuracy": 0.5}]}


def test_optimizer_and_weight_decay_reach_the_trainer(monkeypatch):
    seen = {}
    monkeypatch.setattr("dpzoo.runs.classifier.train_image_classifier", lambda **kw: seen.update(kw) or _done(kw))
    assert main(["train", "cnn-tanh-gn", "--optimizer", "adamw", "--weight-decay", "0.01", "--quiet"]) == 0
    assert (seen["optimizer"], seen["weight_decay"]) == ("adamw", 0.01)


def test_sgd_with_weight_decay_trains_and_is_recorded():
    result = train_image_classifier(
        "cnn-tanh-gn", epochs=1, batch_size=256, lr=0.5, optimizer="sgd", weight_decay=1e-4,
        noise_seed=0, sample_seed=0, log=lambda m: None, progress=False,
    )  # fmt: skip
    assert (result["optimizer"], result["weight_decay"]) == ("sgd", 1e-4) and result["steps"] > 0


def test_learning_rate_schedules_rise_over_the_warmup_then_follow_their_shape():
    from dpzoo.runs.classifier import lr_schedule

    def factors(schedule, warmup, total=10):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        sched = lr_schedule(opt, schedule, warmup, total)
        seen = []
        for _ in range(total):
            seen.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return seen

    assert lr_schedule(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), "constant", 0.0, 10) is None
    assert factors("constant", 0.2) == pytest.approx([0.5, 1.0] + [1.0] * 8)
    assert factors("linear", 0.0) == pytest.approx([1 - i / 10 for i in range(10)])
    cosine = factors("cosine", 0.2)
    assert cosine[:2] == pytest.approx([0.5, 1.0]) and cosine[2] == pytest.approx(1.0)
    assert cosine[-1] == pytest.approx(0.5 * (1 + math.cos(math.pi * 7 / 8)))
    assert all(a >= b for a, b in zip(cosine[1:], cosine[2:]))  # non-increasing after the warm-up


def test_schedule_is_recorded_and_reaches_the_trainer_and_sequence_models_refuse_it(monkeypatch, capsys):
    from cli_errors import one_line_error

    from dpzoo.cli.image import SCHEDULES
    from dpzoo.runs.classifier import SCHEDULES as TRAINER_SCHEDULES

    assert SCHEDULES == TRAINER_SCHEDULES
    seen = {}
    monkeypatch.setattr("dpzoo.runs.classifier.train_image_classifier", lambda **kw: seen.update(kw) or _done(kw))
    assert main(["train", "cnn-tanh-gn", "--schedule", "cosine", "--warmup", "0.1", "--quiet"]) == 0
    assert (seen["schedule"], seen["warmup"]) == ("cosine", 0.1)
    monkeypatch.undo()
    assert "--schedule is for image classifiers" in one_line_error(
        capsys, ["train", "gru-seqrec", "--schedule", "cosine"]
    )


def test_a_scheduled_run_records_its_schedule_and_a_wrong_one_is_refused(tmp_path):
    result = train_image_classifier(
        "cnn-tanh-gn", epochs=1, batch_size=256, lr=1e-2, schedule="linear", warmup=0.5, out=tmp_path,
        noise_seed=0, sample_seed=0, log=lambda m: None, progress=False,
    )  # fmt: skip
    settings = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["settings"]
    assert (settings["schedule"], settings["warmup"]) == ("linear", 0.5) and result["steps"] > 1
    with pytest.raises(dpzoo.DPZooError, match="schedule must be one of"):
        train_image_classifier("cnn-tanh-gn", epochs=1, schedule="step", log=lambda m: None, progress=False)


@pytest.mark.parametrize("name", [n for n in dpzoo.list_models() if dpzoo.model_card(n).task == "image-classification"])
def test_every_image_entry_takes_the_clis_default_digits_size(name):
    """`dpzoo train convnext-tiny` crashed in torch on 16-pixel digits (its card now upscales them)."""
    from dpzoo.cli.train import default_image_size

    size = default_image_size(name, "digits")
    card = dpzoo.model_card(name)
    overrides = {**card.test_overrides, **({"img_size": size} if "img_size" in card.overrides else {})}
    assert dpzoo.load(name, **overrides)(torch.randn(2, 3, size, size)).shape == (2, 10)
