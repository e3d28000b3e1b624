"""The options of ``dpzoo train`` that only sequence models take (``--max-len``, ``--item-prior``,
``--amazon-columns``, ...); ``dpzoo.cli.train`` refuses them for image models."""

from __future__ import annotations

import argparse

from .args import option, positive_float, positive_int

__all__ = ["add_seqrec_options"]


def add_seqrec_options(s: argparse.ArgumentParser, max_len: str) -> None:
    """Add the sequence-model options to the ``train`` parser ``s`` (``max_len``: the datasets'
    default lengths, for the help)."""
    option(
        s,
        "--amazon-columns",
        default=None,
        metavar="ORDER",
        choices=["user,item,rating,timestamp", "item,user,rating,timestamp"],
        help="sequence models: column order of an Amazon CSV given as a path, user,item,rating,timestamp (2014 "
        "release) or item,user,rating,timestamp (2018); default: told from the ids' shape",
    )
    option(
        s,
        "--item-prior",
        default=None,
        choices=["private", "public", "none"],
        help="sequence models: start the output bias at the items' log-frequencies, released with DP inside ε "
        "(private, the default), exact and outside ε (public: the DPFormer paper's assumption), or not at all "
        "(none)",
    )
    option(
        s,
        "--item-prior-noise",
        type=positive_float,
        default=None,
        help="sequence models: noise multiplier of the private item prior's Gaussian release (default 5.0; "
        "larger spends less ε on it)",
    )
    option(
        s,
        "--max-len",
        type=positive_int,
        default=None,
        help=f"sequence models: items per input sequence (default: {max_len + ', ' if max_len else ''}else 50)",
    )
    option(
        s,
        "--non-private",
        kind="flag",
        help="sequence models: the same training without clipping or noise (a reference, no guarantee)",
    )
