"""The options of ``dpzoo train`` that only image classifiers take (``--image-size``,
``--optimizer``, ``--full-size``); ``dpzoo.cli_train`` refuses them for sequence models."""

from __future__ import annotations

import argparse
import os

from .cli_args import option, positive_int
from .errors import InvalidArgumentError

__all__ = ["add_image_options", "check_image_options"]


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
        help="image models: what the noisy gradient feeds (SGD with momentum 0.9; any choice keeps ε); default: adam",
    )
    option(
        s,
        "--full-size",
        kind="flag",
        help="image models: the entry's full size instead of its small configuration (default: small)",
    )


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
