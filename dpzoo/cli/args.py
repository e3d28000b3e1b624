"""Argument parsing of the ``dpzoo`` command line: one-line errors, checked values, defaults in --help.

Every mistake on the command line is one line on stderr (``dpzoo: error: ...``) and exit
code 2, never argparse's usage block or a traceback. Values are checked when they are parsed
(a budget ε > 0, 0 < δ < 1, at least one epoch, ...), so nothing is loaded or trained with an
argument that cannot work. The actions here also record which options the user gave, so that
an option that does not apply (``--max-len`` for an image model, ``--epochs`` with
``--resume``) is refused instead of ignored. Imports nothing heavy: ``dpzoo --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

__all__ = [
    "Parser",
    "option",
    "given",
    "positive_float",
    "unit_interval",
    "positive_int",
    "nonnegative_int",
    "nonnegative_float",
    "key_value",
    "checkpoint_every",
    "physical_batch_size",
]


class _HelpFormatter(argparse.HelpFormatter):
    """Help text wrapped at spaces only: model names like ``transformer-seqrec`` stay whole."""

    def _split_lines(self, text, width):
        import textwrap

        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (``dpzoo: error: ...``), exit code 2, and
    whose help never splits a hyphenated name across lines."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"dpzoo: error: {message} (`{self.prog} --help` lists the options)\n")


def given(args: argparse.Namespace) -> set[str]:
    """The destinations of the options the user gave on the command line (not their defaults)."""
    return set(getattr(args, "given_options", ()))


def _mark(namespace: argparse.Namespace, dest: str) -> None:
    namespace.given_options = given(namespace) | {dest}


class _Store(argparse.Action):
    """``store``, noting that the option was given."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        _mark(namespace, self.dest)


class _Flag(argparse.Action):
    """``store_true``, noting that the option was given."""

    def __init__(self, option_strings, dest, default=False, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=default, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True)
        _mark(namespace, self.dest)


class _Append(argparse.Action):
    """``append``, noting that the option was given."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or []), values])
        _mark(namespace, self.dest)


def _shown(default: Any) -> str:
    if isinstance(default, float):
        return f"{default:g}"
    return str(default)


def option(parser: argparse.ArgumentParser, *flags: str, help: str, kind: str = "store", **kwargs) -> None:
    """Add an option whose help is a sentence followed by its default ("(default: 8)", "(default:
    off)" for a flag), unless the help names it already or it is None (then the sentence must say
    what happens without the option). ``kind``: "store", "flag" (on/off) or "append" (repeatable)."""
    action = {"store": _Store, "flag": _Flag, "append": _Append}[kind]
    default = kwargs.get("default")
    if "default" not in help:
        if kind == "flag":
            help = f"{help} (default: off)"
        elif default is not None:
            help = f"{help} (default: {_shown(default)})"
    parser.add_argument(*flags, action=action, help=help, **kwargs)


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def positive_float(text: str) -> float:
    """A finite number > 0 (ε, learning rate, clipping bound)."""
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def nonnegative_float(text: str) -> float:
    """A finite number >= 0 (weight decay)."""
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def unit_interval(text: str) -> float:
    """A number strictly between 0 and 1 (δ, a confidence level)."""
    value = _number(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be strictly between 0 and 1, got {text}")
    return value


def positive_int(text: str) -> int:
    """A whole number >= 1 (epochs, batch sizes, lengths)."""
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def nonnegative_int(text: str) -> int:
    """A whole number >= 0 (seeds)."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def key_value(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` of ``--set``: VALUE is read as JSON (``width=16``, ``drop_rate=0.1``,
    ``layers=[1,1,1,1]``), else kept as a string (``gn_groups=auto`` needs no quotes)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. width=16), got {text!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def checkpoint_every(text: str) -> int | str:
    """``epoch`` (a checkpoint after every epoch), ``off``, or N (every N steps)."""
    if text in ("epoch", "off"):
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected 'epoch', 'off' or a number of steps >= 1, got {text!r}") from None


def physical_batch_size(text: str) -> int | str:
    """``auto`` (chosen from the available memory) or N >= 1 (samples per forward and backward pass)."""
    if text == "auto":
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected 'auto' (chosen from the available memory) or a whole number >= 1, got {text!r}"
        ) from None
