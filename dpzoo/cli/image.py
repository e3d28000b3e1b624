"""The options of ``dpzoo train`` that only classifiers take: image, tabular and text
(``--optimizer``, ``--schedule``, ``--warmup``), image only (``--image-size``, ``--full-size``),
tables (``--label-column``), text only (``--text-column``, ``--max-tokens``, ``--weights``,
``--pretrained``); ``dpzoo.cli.train`` refuses them for the other kinds (a sequence model's
schedule is the DPFormer recipe's: 20% warm-up, then linear decay)."""

from __future__ import annotations

import argparse
import os

from ..errors import InvalidArgumentError
from .args import option, positive_int

__all__ = [
    "add_image_options",
    "check_image_options",
    "check_table_options",
    "check_text_options",
    "image_choices",
    "text_choices",
    "CLASSIFIER_ONLY",
]

SCHEDULES = (
    "constant",
    "cosine",
    "linear",
)  # dpzoo.runs.classifier.SCHEDULES (not imported: the parser loads no torch)
CLASSIFIER_ONLY = {  # dest -> (flag, the kinds it is for)
    **{dest: (f"--{dest.replace('_', '-')}", ("image",)) for dest in ("full_size", "image_size")},
    **{dest: (f"--{dest}", ("image", "tabular", "text")) for dest in ("optimizer", "schedule", "warmup")},
    "label_column": ("--label-column", ("tabular", "text")),
    **{
        dest: (f"--{dest.replace('_', '-')}", ("text",))
        for dest in ("text_column", "max_tokens", "weights", "pretrained")
    },
}
TABLE_SUFFIXES = (".csv", ".parquet", ".pq")  # dpzoo.datasets.table's (not imported: no torch here)


def add_image_options(s: argparse.ArgumentParser) -> None:
    """Add the image-classifier options to the ``train`` parser ``s``."""
    option(
        s,
        "--image-size",
        type=positive_int,
        default=None,
        help="image models: images are resized to N×N pixels (default: the model card's recipe if it has one, "
        "else 16 for digits, 32 for an image folder)",
    )
    option(
        s,
        "--optimizer",
        default=None,
        choices=("sgd", "adam", "adamw"),
        help="classifiers: what the noisy gradient feeds (SGD with momentum 0.9; any choice keeps ε); default: adam",
    )
    option(
        s,
        "--schedule",
        default=None,
        choices=SCHEDULES,
        help="classifiers: the learning rate over the run's steps, after --warmup (post-processing: any schedule "
        "keeps ε); default: constant",
    )
    option(
        s,
        "--warmup",
        type=float,
        default=None,
        help="classifiers: the fraction of the steps over which the learning rate rises linearly from 0; default 0",
    )
    option(
        s,
        "--full-size",
        kind="flag",
        help="image models: the entry's full size instead of its small configuration (default: small)",
    )
    option(
        s,
        "--label-column",
        default=None,
        help="tabular and text models: the column of a CSV or Parquet --data that holds the class (default: label); "
        "for a tabular model every other column is a numeric feature, used as it is",
    )
    option(
        s, "--text-column", default=None, help="text models: the column of --data that holds the text (default: text)"
    )
    option(
        s,
        "--max-tokens",
        type=positive_int,
        default=None,
        help="text models: each text is truncated and padded, alone, to N tokens (default 128)",
    )
    option(
        s,
        "--weights",
        default=None,
        metavar="DIR",
        help="text models: the pretrained weights, a Hugging Face directory with its tokenizer; default: none "
        "(give --weights or --pretrained)",
    )
    option(
        s,
        "--pretrained",
        kind="flag",
        help="text models: the card's hub weights and tokenizer (downloaded once); default: off",
    )


def image_choices(args: argparse.Namespace) -> dict:
    """The optional classifier settings the user gave (unset ones keep the trainer's defaults)."""
    keys = ("optimizer", "schedule", "warmup", "label_column")
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def check_image_options(args: argparse.Namespace, data: str) -> None:
    """Refuse what an image classifier cannot take, before anything is built."""
    if args.max_physical_batch_size == "auto":
        raise InvalidArgumentError(
            "--max-physical-batch-size auto is for sequence models; give an image classifier a number of "
            "samples (default: whole batches)."
        )
    if data != "digits" and not os.path.isdir(data):
        raise InvalidArgumentError(
            f"--data {data}: image classifiers train on digits or an image folder "
            "(a directory with one subfolder per class); no such dataset or directory."
        )


def check_table_options(args: argparse.Namespace, data: str) -> None:
    """Refuse what a tabular classifier cannot take, before anything is built."""
    if args.max_physical_batch_size == "auto":
        raise InvalidArgumentError(
            "--max-physical-batch-size auto is for sequence models; give a tabular classifier a number of "
            "samples (default: whole batches)."
        )
    if data == "digits":
        return
    if not data.lower().endswith(TABLE_SUFFIXES):
        raise InvalidArgumentError(
            f"--data {data}: tabular classifiers train on digits (64 features) or a .csv or .parquet file."
        )
    if not os.path.isfile(data):
        raise InvalidArgumentError(f"--data {data}: no such file.")


def text_choices(args: argparse.Namespace) -> dict:
    """The ``text=`` settings of a text classifier's run (the weights as an absolute path)."""
    weights = os.path.abspath(args.weights) if args.weights else None
    return {
        "column": args.text_column or "text",
        "max_length": args.max_tokens or 128,
        "weights": weights,
        "pretrained": bool(args.pretrained),
    }


def check_text_options(args: argparse.Namespace, data: str | None) -> None:
    """Refuse what a text classifier cannot take, before anything is built."""
    if args.max_physical_batch_size == "auto":
        raise InvalidArgumentError("--max-physical-batch-size auto is for sequence models; give a number of samples.")
    if not data or not data.lower().endswith(TABLE_SUFFIXES):
        raise InvalidArgumentError(
            f"{args.name} trains on your texts: --data FILE.csv (or .parquet) with a text column (--text-column)."
        )
    if not os.path.isfile(data):
        raise InvalidArgumentError(f"--data {data}: no such file.")
    if bool(args.weights) == bool(args.pretrained):
        raise InvalidArgumentError(
            f"{args.name} fine-tunes pretrained weights: give --weights DIR (a Hugging Face directory with its "
            "tokenizer) or --pretrained (the card's hub weights), one of the two."
        )
    if args.weights and not os.path.isdir(args.weights):
        raise InvalidArgumentError(f"--weights {args.weights}: no such directory (a Hugging Face model directory).")
