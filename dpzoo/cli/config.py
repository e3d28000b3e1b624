"""``dpzoo train --config FILE``: the options of a run in a YAML or JSON file, as timm's ``train.py``
takes them. The file's keys are the options' names (``epochs``, ``max-grad-norm`` or
``max_grad_norm``, ``set: {width: 16}``; ``name`` or ``model`` for the zoo model); options given on
the command line win. The file is read before anything is built and turned into command-line
options, so every value is checked the way the option itself checks it. A resumed run keeps the
settings its file gave (they are in its checkpoint); with ``--resume`` a file may only hold what
``--resume`` accepts (``checkpoint-every``, ``device``, ``quiet``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import InvalidArgumentError
from .args import option

__all__ = ["add_config_option", "with_config"]


def add_config_option(s: argparse.ArgumentParser) -> None:
    option(
        s,
        "--config",
        default=None,
        metavar="FILE",
        help="a YAML or JSON file of these options (keys: their names, e.g. epochs: 30, set: {width: 16}); "
        "options on the command line win; default: none",
    )


def read_config(path: str) -> dict:
    """The file's mapping of option names to values; one line naming the problem otherwise."""
    import yaml  # a dependency of timm and transformers

    try:
        text = Path(path).read_text()
    except OSError as e:
        raise InvalidArgumentError(f"--config {path}: cannot be read ({e.strerror or e}).") from None
    try:
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        raise InvalidArgumentError(f"--config {path}: not valid {'JSON' if path.endswith('.json') else 'YAML'} "
                                   f"({str(e).splitlines()[0]}).") from None  # fmt: skip
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InvalidArgumentError(
            f"--config {path}: must hold a mapping of option names to values, not {type(data).__name__}."
        )
    return data


def config_tokens(data: dict, parser: argparse.ArgumentParser, path: str) -> tuple[str | None, list[str]]:
    """(the model name, the options as command-line tokens) of a config's mapping."""
    flags = {a.dest: (a.option_strings[0], a.nargs == 0) for a in parser._actions if a.option_strings}
    name, tokens = None, []
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest in ("name", "model"):
            name = str(value)
            continue
        if dest not in flags or dest in ("config", "help"):
            known = ", ".join(sorted(d.replace("_", "-") for d in flags if d not in ("config", "help")))
            raise InvalidArgumentError(f"--config {path}: unknown option {key!r}; the options are name, {known}.")
        flag, is_flag = flags[dest]
        if is_flag:
            if not isinstance(value, bool):
                raise InvalidArgumentError(f"--config {path}: {key} is a switch: true or false, not {value!r}.")
            tokens += [flag] if value else []
            continue
        items = value.items() if isinstance(value, dict) else value if isinstance(value, list) else [value]
        for item in items:  # set: {width: 16} or [width=16]: one --set each
            text = f"{item[0]}={json.dumps(item[1])}" if isinstance(value, dict) else str(item)
            tokens += [flag, text]
    return name, tokens


def with_config(parser: argparse.ArgumentParser, argv: list[str], args: argparse.Namespace) -> argparse.Namespace:
    """``args`` re-parsed with the config's options before the command line's (which win)."""
    train = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    name, tokens = config_tokens(read_config(args.config), train, args.config)
    position = argv.index("train") + 1
    head = [name] if name is not None and args.name is None and args.resume is None else []
    return parser.parse_args([*argv[:position], *head, *tokens, *argv[position:]])
