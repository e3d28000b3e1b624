"""The options of ``dpzoo train`` that only classifiers take: image and tabular (``--optimizer``,
``--schedule``, ``--warmup``), image only (``--image-size``, ``--full-size``), tabular only
(``--label-column``); ``dpzoo.cli_train`` refuses them for the other kinds (a sequence model's
schedule is the DPFormer recipe's: 20% warm-up, then linear decay)."""

from __future__ import annotations

import argparse
import os

from .cli_args import option, positive_int
from .errors import InvalidArgumentError

__all__ = ["add_image_options", "check_image_options", "check_table_options", "image_choices", "CLASSIFIER_ONLY"]

SCHEDULES = ("constant", "cosine", "linear")  # dpzoo.train.SCHEDULES (not imported: the parser loads no torch)
CLASSIFIER_ONLY = {  # dest -> (flag, the kinds it is for)
    **{dest: (f"--{dest.replace('_', '-')}", ("image",)) for dest in ("full_size", "image_size")},
    **{dest: (f"--{dest}", ("image", "tabular")) for dest in ("optimizer", "schedule", "warmup")},
    "label_column": ("--label-column", ("tabular",)),
}
TABLE_SUFFIXES = (".csv", ".parquet", ".pq")  # dpzoo.datasets.table's (not imported: no torch here)


def add_image_options(s: argparse.ArgumentParser) -> None:
    """Add the image-classifier options to the ``train`` parser ``s``."""
    option(
        s,
        "--image-size",
        type=positive_int,
        default=None,
        help="image models: images are resized to N×N pixels (default: 16 for digits, 32 for an image folder)",
    )
    option(
        s,
        "--optimizer",
        default=None,
        choices=("sgd", "adam", "adamw"),
        help="image and tabular models: what the noisy gradient feeds (SGD with momentum 0.9; any choice keeps ε); default: adam",
    )
    option(
        s,
        "--schedule",
        default=None,
        choices=SCHEDULES,
        help="image and tabular models: the learning rate over the run's steps, after --warmup (post-processing: any schedule "
        "keeps ε); default: constant",
    )
    option(
        s,
        "--warmup",
        type=float,
        default=None,
        help="image and tabular models: the fraction of the steps over which the learning rate rises linearly from 0; default 0",
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
        help="tabular models: the column of a CSV or Parquet --data that holds the class (default: label); every "
        "other column is a numeric feature, used as it is",
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
