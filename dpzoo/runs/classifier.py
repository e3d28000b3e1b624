"""``dpzoo train`` for classifiers: private training of a zoo model on a built-in dataset or the user's.

Image classifiers (ResNet-GN, ViT, EfficientNet-GN) train on scikit-learn's digits (bundled,
no download) or on the user's image folder (:mod:`dpzoo.datasets.image_folder`); tabular
classifiers (``mlp-tanh``) on the digits as 64 features or on the user's CSV or Parquet file
(:mod:`dpzoo.datasets.table`); privately, with dpzoo's engine. The run (:class:`ClassifierRun` over :class:`dpzoo.runs.run.TrainingRun`)
shows a progress bar with the loss and the ε spent, evaluates the test accuracy every
``eval_every`` epochs into ``metrics.csv`` (and TensorBoard when installed), saves checkpoints
it can resume from with the same ε bookkeeping, and at the end writes metrics.json, a plot
and the model with its privacy metadata.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from ..datasets import digits_dataset, digits_features, image_folder_splits, is_image_folder, is_table, table_splits
from ..datasets.text import PackedTextClassifier, load_tokenizer, text_splits
from ..errors import DPZooError, InvalidArgumentError
from ..hub.load_save import load
from .loop import check_loop_arguments
from .run import TrainingRun

__all__ = [
    "train_image_classifier",
    "image_splits",
    "table_data",
    "evaluate_accuracy",
    "lr_schedule",
    "IMAGE_DATASETS",
    "SCHEDULES",
    "CLASSIFIER_TASKS",
    "ClassifierRun",
]

IMAGE_DATASETS = ("digits",)
# overrides the data fixes (10 classes of 16×16 images): --set cannot change them
_DATA_OVERRIDES = {
    "num_classes": "the number of classes is the data's",
    "num_labels": "the number of classes is the data's",
    "img_size": "the images are image_size pixels",
    "in_features": "the features are the table's columns",
}
CLASSIFIER_TASKS = ("image-classification", "tabular-classification", "sequence-classification")


def image_splits(data: str, image_size: int, seed: int = 0):
    """(train, test, class names) of ``data``: the built-in digits or an image folder."""
    if data == "digits":
        train, test = digits_dataset(size=image_size)
        return train, test, [str(i) for i in range(10)]
    return image_folder_splits(data, image_size, seed=seed)


def table_data(data: str, label_column: str = "label", seed: int = 0):
    """(train, test, class names, feature names) of ``data``: the built-in digits as 64 features, or
    a CSV / Parquet file whose ``label_column`` is the class."""
    if data == "digits":
        train, test = digits_features(seed=seed)
        return train, test, [str(i) for i in range(10)], [f"pixel{i}" for i in range(64)]
    return table_splits(data, label_column, seed=seed)


_DEFAULTS = {"optimizer": "adam", "weight_decay": 0.0, "schedule": "constant", "warmup": 0.0, "label_column": "label"}
OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "cosine", "linear")


def _check_data(card, data: str, text: dict | None) -> None:
    """Refuse data the entry's task cannot train on, before anything is read."""
    task = card.task
    if task not in CLASSIFIER_TASKS:
        raise DPZooError(f"dpzoo train {card.name}: this trains classifiers ({card.name} is {task}).")
    if task == "sequence-classification":
        if not is_table(data) or text is None or not (text.get("weights") or text.get("pretrained")):
            raise InvalidArgumentError(
                f"{card.name} trains on a .csv or .parquet file with a text column, from pretrained weights: "
                "--data FILE --text-column NAME and --weights DIR (a Hugging Face directory) or --pretrained."
            )
    elif task == "tabular-classification" and data != "digits" and not is_table(data):
        raise InvalidArgumentError(
            f"Unknown dataset {data!r} for a tabular classifier: 'digits' (built in, 64 features) or a .csv or "
            ".parquet file."
        )
    elif task == "image-classification" and data not in IMAGE_DATASETS and not is_image_folder(data):
        raise InvalidArgumentError(
            f"Unknown dataset {data!r} for an image classifier: 'digits' (built in) or an image folder (a directory "
            "with one subfolder per class)."
        )


def _data_and_model(card, data, image_size, small, seed, label_column, text, overrides):
    """(train, test, class names, model, what metrics.json records about the data, tokenizer or
    None) for the entry's task."""
    task, kwargs = card.task, dict(overrides)
    if task == "sequence-classification":
        assert text is not None  # _check_data
        source = text.get("weights") or next(iter(card.pretrained_tags))
        tokenizer = load_tokenizer(source)
        max_length = int(text.get("max_length", 128))
        train, test, classes = text_splits(data, text["column"], label_column, tokenizer, max_length, seed=seed)
        weights = {"weights": text["weights"]} if text.get("weights") else {"pretrained": True}
        model = PackedTextClassifier(load(card.name, num_classes=len(classes), **weights, **kwargs))
        recorded = {"text": {"column": text["column"], "max_length": max_length}, "label_column": label_column}
        return train, test, classes, model, recorded, tokenizer
    if small:
        kwargs = {**card.test_overrides, **kwargs}
    if task == "tabular-classification":
        train, test, classes, features = table_data(data, label_column, seed)
        model = load(card.name, **{**kwargs, "num_classes": len(classes), "in_features": len(features)})
        return train, test, classes, model, {"features": features, "label_column": label_column}, None
    train, test, classes = image_splits(data, image_size, seed)
    if "img_size" in card.overrides:
        kwargs["img_size"] = image_size
    model = load(card.name, **{**kwargs, "num_classes": len(classes)})
    return train, test, classes, model, {"image_size": image_size}, None


def lr_schedule(optimizer, schedule: str, warmup: float, total_steps: int):
    """The learning rate's factor per step (``torch.optim.lr_scheduler.LambdaLR``, stepped after each
    logical step): a linear rise over the first ``warmup`` fraction of the steps, then ``schedule``
    (constant, cosine or linear decay to 0 at the last step); None when it is constant throughout."""
    if schedule == "constant" and warmup == 0:
        return None
    rise = max(1, round(warmup * total_steps)) if warmup > 0 else 0

    def factor(step: int) -> float:
        if step < rise:
            return (step + 1) / rise
        done = min(1.0, (step - rise) / max(1, total_steps - rise))
        return {"constant": 1.0, "cosine": 0.5 * (1 + math.cos(math.pi * done)), "linear": 1 - done}[schedule]

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _optimizer(name: str, params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """The optimizer the noisy gradient feeds (post-processing: any choice keeps ε). SGD with
    momentum 0.9; weight decay as each optimizer defines it (AdamW: decoupled)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    raise InvalidArgumentError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}.")


def evaluate_accuracy(model, dataset, device, batch_size=256) -> float:
    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in DataLoader(dataset, batch_size=batch_size):
            correct += (model(x.to(device)).argmax(1).cpu() == y).sum().item()
    model.train()
    return correct / len(dataset)


def train_image_classifier(
    name: str,
    *,
    data: str = "digits",
    epsilon: float = 8.0,
    delta: float = 1e-5,
    epochs: int = 5,
    batch_size: int = 64,
    lr: float = 1e-3,
    optimizer: str = "adam",
    weight_decay: float = 0.0,
    schedule: str = "constant",
    warmup: float = 0.0,
    mode: str = "bk-mixopt",
    clipping: str = "automatic",
    max_grad_norm: float = 1.0,
    image_size: int = 16,
    small: bool = True,
    out: str | Path | None = None,
    seed: int = 0,
    accountant: str = "rdp",
    overrides: dict | None = None,
    log: Callable[[str], None] = print,
    device: str | torch.device = "cpu",
    max_physical_batch_size: int | None = None,
    eval_every: int = 1,
    noise_seed: int | None = None,
    sample_seed: int | None = None,
    checkpoint_every: int | str = "epoch",
    resume: str | Path | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
    step_callback: Callable[[int], None] | None = None,
    handle_sigint: bool = False,
    label_column: str = "label",
    text: dict | None = None,
) -> dict:
    """Train ``name`` with DP on ``data``; returns the metrics (also written to ``out``).

    An image classifier trains on ``"digits"`` or an image folder (``image_size`` pixels); a
    tabular one (``mlp-tanh``) on ``"digits"`` as 64 features or a CSV / Parquet file whose
    ``label_column`` is the class (every other column a numeric feature, used as it is); a
    sequence classifier (``bert-base``, ``roberta-base``) on a CSV / Parquet file with a text
    column, ``text = {"column": "text", "max_length": 128, "weights": DIR}`` (or ``"pretrained":
    True``: the card's hub weights), tokenized by those weights' own tokenizer
    (:mod:`dpzoo.datasets.text`).

    ``seed`` fixes the initialisation and the data split; Poisson membership and noise are
    secret unless ``sample_seed`` / ``noise_seed`` are given (tests only: recorded in the
    privacy metadata). ``out``: a new or empty directory (``overwrite=True`` replaces an earlier
    run's results in it), checked before training; it receives metrics.csv per evaluation,
    TensorBoard events (with the ``tensorboard`` package), ``checkpoint.pt`` after every epoch
    (``checkpoint_every``: "epoch", "off" or every N steps; also on Ctrl-C), then
    metrics.json, metrics.png (with matplotlib) and the model with its privacy metadata.
    ``resume``: a run directory (or its checkpoint.pt), continued with the same settings,
    which must be the ones given here; the accountant's history continues, so the final ε is the
    one of an uninterrupted run. ``step_callback(step)`` runs after every logical step;
    ``progress`` shows a progress bar (None: when stderr is a terminal)."""
    return ClassifierRun(dict(locals())).run()


class ClassifierRun(TrainingRun):
    """:func:`train_image_classifier`'s run: a classifier on images, a table or texts."""

    def make_settings(self) -> dict:
        o = self.o
        if o.data != "digits" and (is_image_folder(o.data) or is_table(o.data)):
            o.data = str(Path(o.data).resolve())  # a resumed run finds it from any directory
        names = ("name", "data", "epsilon", "delta", "epochs", "batch_size", "lr", "mode", "clipping", "max_grad_norm",
                 "image_size", "small", "seed", "accountant")  # fmt: skip
        settings: dict[str, Any] = {"kind": "image", **{n: getattr(o, n) for n in names}}
        settings["overrides"] = dict(o.overrides or {})
        settings.update(
            {n: getattr(o, n) for n in ("max_physical_batch_size", "eval_every", "noise_seed", "sample_seed")}
        )
        if o.text is not None:
            settings["text"] = dict(o.text)
        # recorded only when not the default, so runs from before these options resume unchanged
        settings.update({k: getattr(o, k) for k, v in _DEFAULTS.items() if getattr(o, k) != v})
        return settings

    def check(self) -> None:
        o = self.o
        if o.schedule not in SCHEDULES or not 0 <= o.warmup < 1:
            raise InvalidArgumentError(
                f"schedule must be one of {', '.join(SCHEDULES)} and warmup a fraction of the steps in [0, 1); got "
                f"{o.schedule!r}, {o.warmup!r}."
            )
        check_loop_arguments(epochs=o.epochs, eval_every=o.eval_every, checkpoint_every=o.checkpoint_every)
        from ..models import model_card  # the zoo loads on first lookup, not with this module

        self.card = model_card(o.name)
        _check_data(self.card, o.data, o.text)
        fixed = sorted(set(self.settings["overrides"]) & set(_DATA_OVERRIDES))
        if fixed:
            raise InvalidArgumentError(
                f"override {fixed[0]!r} is set by the data ({_DATA_OVERRIDES[fixed[0]]}): drop it."
            )

    def build(self, device, checkpoint):
        o = self.o
        self.train, self.test, self.classes, model, self.recorded, self.tokenizer = _data_and_model(
            self.card, o.data, o.image_size, o.small, o.seed, o.label_column, o.text, self.settings["overrides"]
        )
        self.rows = "images" if self.card.task == "image-classification" else "rows"
        if o.batch_size > len(self.train):
            raise InvalidArgumentError(
                f"batch_size {o.batch_size} is larger than the {len(self.train)} training {self.rows} (the sample "
                f"rate would exceed 1): use at most {len(self.train)}."
            )
        return model.train().to(device), self.train

    def optimizer(self, model):
        return _optimizer(self.o.optimizer, model.parameters(), self.o.lr, self.o.weight_decay)

    def engine_options(self, model, device) -> dict:
        return {"max_physical_batch_size": self.o.max_physical_batch_size}

    def scheduler(self, optimizer, engine, total_steps):
        return lr_schedule(optimizer, self.o.schedule, self.o.warmup, total_steps)

    def first_line(self, engine, loop, resumed) -> str:
        o = self.o
        return (
            f"{o.name} on {o.data}: {len(self.train)} train / {len(self.test)} test {self.rows}, mode {o.mode}, "
            f"σ = {engine.noise_multiplier:.3f}, q = {engine.sample_rate:.4f}, {loop.total_steps} steps, "
            f"target ε = {o.epsilon} at δ = {o.delta}"
            + (f" (resumed after step {loop.step}, ε = {loop.epsilon():.3g} so far)" if resumed else "")
        )

    def loss(self, model, batch, device):
        x, y = batch
        return F.cross_entropy(model(x.to(device)), y.to(device))

    def evaluate(self, model, device) -> dict:
        return {"test_accuracy": evaluate_accuracy(model, self.test, device)}

    def describe(self, r: dict) -> str:
        return (
            f"epoch {r['epoch']}: test accuracy {r['test_accuracy']:.3f}  ε = {r['epsilon']:.2f}  ({r['seconds']:.0f}s)"
        )

    def result(self, engine, loop, history, device) -> dict:
        o = self.o
        return {
            "model": o.name,
            "data": o.data,
            "classes": self.classes,
            **self.recorded,
            **{
                n: getattr(o, n)
                for n in ("mode", "clipping", "epochs", "batch_size", "lr", "optimizer", "weight_decay")
            },
            "delta": o.delta,
            "epsilon_target": o.epsilon,
            "epsilon": loop.epsilon(),
            "steps": loop.step,
            "noise_multiplier": engine.noise_multiplier,
            "sample_rate": engine.sample_rate,
            "accountant": o.accountant,
            "seed": o.seed,
            "device": str(device),
            "history": history,
        }

    def plot(self):
        o = self.o
        return (
            f"{o.name} on {o.data}, target ε = {o.epsilon} at δ = {o.delta}",
            [("test_accuracy", "test accuracy")],
            {},
        )

    def datasets(self):
        return [self.o.data] if self.o.data in IMAGE_DATASETS else None

    def saved_model(self, model):
        return model.model if isinstance(model, PackedTextClassifier) else model

    def save_extras(self, run_dir: Path) -> None:
        if self.tokenizer is not None:  # dpzoo eval tokenizes new texts with it
            self.tokenizer.save_pretrained(run_dir / "model")
