"""The kinds of model ``dpzoo train`` trains (by the zoo entry's task), what each defaults to, and
which options only some kinds take (:mod:`dpzoo.cli.train` refuses the others)."""

from __future__ import annotations

from typing import Any

from ..errors import DPZooError
from .image import CLASSIFIER_ONLY

__all__ = [
    "KINDS",
    "KIND_WORDS",
    "KIND_PLURALS",
    "CLASSIFIER_KINDS",
    "KIND_ONLY",
    "DEFAULT_DATA",
    "DEFAULT_EVAL_EVERY",
    "DEFAULT_STEPS",
    "model_kind",
]

KINDS = {
    "image-classification": "image",
    "tabular-classification": "tabular",
    "sequence-classification": "text",
    "sequential-recommendation": "seqrec",
}
KIND_WORDS = {k: f"a{'n' * (k == 'image')} {k} classifier" for k in ("image", "tabular", "text")}
KIND_WORDS["seqrec"] = "a sequence model"
KIND_PLURALS = {"image": "image classifiers", "tabular": "tabular classifiers", "text": "text classifiers"}
KIND_PLURALS["seqrec"] = "sequence models"
CLASSIFIER_KINDS = ("image", "tabular", "text")  # trained by dpzoo.runs.classifier.train_image_classifier
# options of some kinds only: dest -> (flag, the kinds it is for)
KIND_ONLY = {
    **CLASSIFIER_ONLY,
    **{
        dest: (f"--{dest.replace('_', '-')}", ("seqrec",))
        for dest in ("max_len", "non_private", "amazon_columns", "item_prior", "item_prior_noise")
    },
}
DEFAULT_DATA = {"image": "digits", "tabular": "digits", "text": None, "seqrec": "synthetic"}
DEFAULT_EVAL_EVERY = {"image": 1, "tabular": 1, "text": 1, "seqrec": 5}
# the recipes; sequence models: the ε = 5 MovieLens-1M recipe (docs/RESULTS.md), batch size from the data (None)
DEFAULT_STEPS: dict[str, dict[str, Any]] = {
    "image": {"epochs": 10, "batch_size": 64, "lr": 2e-3},
    "tabular": {"epochs": 10, "batch_size": 64, "lr": 2e-3},
    "text": {"epochs": 3, "batch_size": 64, "lr": 5e-4},
    "seqrec": {"epochs": 20, "batch_size": None, "lr": 1e-2},
}


def model_kind(name: str) -> str:
    """The kind of a zoo entry ``dpzoo train`` trains ("image", "tabular", "text" or "seqrec"); others are refused."""
    from ..models import model_card

    task = model_card(name).task
    if task not in KINDS:
        raise DPZooError(
            f"dpzoo train {name}: only image, tabular and text classifiers and sequence models train from the CLI for now "
            f"({name} is {task}); `dpzoo train --help` lists them."
        )
    return KINDS[task]
