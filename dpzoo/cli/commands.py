"""The ``dpzoo`` command line: its parser, the commands other than ``train``, and one-line errors.

dpzoo list [PATTERN]                 zoo entries
dpzoo card NAME|DIR                  the model card, or a saved model's privacy statement
dpzoo summary NAME [--set k=v ...]   parameters, bias share, norms, ties
dpzoo prepare NAME [--set k=v ...] [--weights PATH] [--out DIR]
                                     build a DP-ready model, check it, run one
                                     forward/backward on a synthetic batch, save it
dpzoo cards --write DIR              (re)write the markdown model cards
dpzoo train NAME [--data digits] [--epsilon 8] [--epochs 10] [--out DIR] [--resume DIR] ...
                                     private training on a built-in dataset (dpzoo.cli.train)
dpzoo audit [--epsilon 2] [--delta 1e-5] [--canaries 1000|2500] [--epochs 10] [--full-batch] [--mode auto]
            [--broken NAME | --with-controls] [--white-box] [--out DIR] [--seed 0]
                                     empirical lower bound on ε in one training run (exit 1
                                     when it exceeds the claimed ε; dpzoo.cli.audit)
dpzoo audit --run RUN_DIR [--with-controls]
                                     audit a saved model's mechanism, recorded in its card

Every mistake is one line on stderr (``dpzoo: error: ...``) and exit code 2: argparse's errors
(:class:`dpzoo.cli.args.Parser`), every :class:`~dpzoo.DPZooError` a command raises, and an
operating-system error (a file that cannot be read or written). Ctrl-C during training saves
a checkpoint and exits 130 with the command that resumes. torch, timm and transformers are
imported inside the commands, so ``dpzoo --help`` answers at once.
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from pathlib import Path

from ..errors import DPZooError
from .args import Parser, key_value, option
from .audit import add_audit_parser
from .config import with_config
from .evaluate import add_eval_parser
from .train import add_train_parser

__all__ = ["build_parser", "main"]


def _example_batch(card, batch_size=4):
    import torch

    spec = card.example_input
    g = torch.Generator().manual_seed(0)
    if spec.get("kind") in ("image", "features"):
        return (torch.randn(batch_size, *spec["shape"], generator=g),), {}
    if spec.get("kind") in ("tokens", "seq2seq"):
        ids = {"input_ids": torch.randint(0, spec["vocab_size"], (batch_size, spec["seq_len"]), generator=g)}
        if spec["kind"] == "seq2seq":  # and the decoder's input
            ids["decoder_input_ids"] = torch.randint(
                0, spec["vocab_size"], (batch_size, spec["target_len"]), generator=g
            )
        return (), ids
    return None


def _cmd_list(args) -> int:
    from ..models import list_models, model_card

    for name in list_models(args.pattern):
        print(f"{name:<24} {model_card(name).summary}")
    return 0


def _cmd_card(args) -> int:
    """A zoo entry's model card, or a saved model's (or a run's) privacy statement."""
    if Path(args.name).is_dir():
        from ..hub.statement import privacy_statement

        if args.registry:
            return _print_registry_record(args.name)
        print(privacy_statement(args.name))
        return 0
    if args.registry:
        raise DPZooError(f"--registry needs a saved private model's directory; {args.name} is not a directory.")
    from ..models import model_card

    print(model_card(args.name).to_markdown(), end="")
    return 0


def _print_registry_record(directory) -> int:
    import yaml

    from ..hub.deployments_registry import registry_record
    from ..hub.load_save import run_model_directory
    from ..hub.privacy_card import read_card
    from ..hub.saved_files import read_privacy_metadata

    model_dir = run_model_directory(directory)
    record, front = read_privacy_metadata(model_dir), read_card(model_dir) or {}
    if record is None or not math.isfinite(record["epsilon"]):
        raise DPZooError(
            f"{directory} holds no model trained with DP (no record, or ε = ∞): there is nothing to register."
        )
    entry = registry_record(
        record, front.get("dpzoo_model", Path(directory).name), audit=(front.get("privacy") or {}).get("audit")
    )
    print(yaml.safe_dump(entry, sort_keys=False, allow_unicode=True), end="")
    return 0


def _build(args):
    from ..hub.load_save import load
    from ..models import model_card

    overrides = dict(args.set or [])
    if getattr(args, "small", False):
        overrides = {**model_card(args.name).test_overrides, **overrides}
    if getattr(args, "meta", False):
        import torch

        with torch.device("meta"):
            return load(args.name, **overrides)
    return load(args.name, weights=getattr(args, "weights", None), **overrides)


def _cmd_summary(args) -> int:
    from ..summary import summary

    print(summary(_build(args)))
    return 0


def _cmd_prepare(args) -> int:
    import torch

    from ..hub.load_save import save
    from ..models import model_card
    from ..summary import summary
    from ..surgery import check_dp_ready

    card = model_card(args.name)
    model = _build(args)
    report = model.dpzoo_patch_report
    print(f"{args.name}: DP-ready")
    for line in report.lines() or ["no patches needed"]:
        print(f"  - {line}")
    problems = check_dp_ready(model, bias_exempt=card.bias_exempt, require_bias=True)
    for p in problems:
        print(f"  ! {p}")
    print(summary(model))
    batch = _example_batch(card)
    if batch is not None and not args.small:
        print("(synthetic batch skipped: it matches the small configuration; pass --small)")
    elif batch is not None:
        model.train()
        out = model(*batch[0], **batch[1])
        out = out if isinstance(out, torch.Tensor) else out.logits
        out.float().pow(2).mean().backward()
        print(f"forward/backward on a synthetic batch: output {list(out.shape)}, ok")
    if args.out:
        path = save(model, args.out)
        print(f"saved to {path}")
    return 1 if problems else 0


def _cmd_cards(args) -> int:
    from ..models import list_models, model_card

    out = Path(args.write)
    out.mkdir(parents=True, exist_ok=True)
    for name in list_models():
        (out / f"{name}.md").write_text(model_card(name).to_markdown())
    print(f"wrote {len(list_models())} cards to {out}")
    return 0


def _add_model_commands(sub) -> None:
    s = sub.add_parser("list", help="list zoo entries", description="List the zoo's entries with a one-line summary.")
    s.add_argument("pattern", nargs="?", default="*", help="an fnmatch pattern of names, e.g. 'vit*' (default: *)")
    s.set_defaults(fn=_cmd_list)
    s = sub.add_parser(
        "card",
        help="print a model card, or a saved model's privacy statement",
        description="Print a zoo entry's model card (markdown), or the privacy guarantee of a saved model in plain "
        "words (a dpzoo.save or DPTrainer directory, or a dpzoo train --out run).",
    )
    s.add_argument("name", help="a zoo entry (`dpzoo list` lists them) or a saved model's directory")
    option(
        s,
        "--registry",
        kind="flag",
        help="print the saved model's draft record for the Differential Privacy Deployments Registry (YAML) "
        "instead of the statement; default: the statement",
    )
    s.set_defaults(fn=_cmd_card)
    for cmd, fn, hlp in (
        ("summary", _cmd_summary, "parameter counts, bias share, norms, ties"),
        ("prepare", _cmd_prepare, "build, check, smoke-test and save a DP-ready model"),
    ):
        s = sub.add_parser(cmd, help=hlp, description=hlp[0].upper() + hlp[1:] + ".")
        s.add_argument("name", help="a zoo entry (`dpzoo list` lists them)")
        option(
            s,
            "--set",
            kind="append",
            type=key_value,
            metavar="KEY=VALUE",
            help="a model override, repeatable, VALUE read as JSON (e.g. --set width=16); none by default",
        )
        option(s, "--small", kind="flag", help="start from the card's small test configuration (default: full size)")
        if cmd == "summary":
            option(s, "--meta", kind="flag", help="build on the meta device: full size, no memory")
        else:
            option(s, "--weights", default=None, help="a local checkpoint to convert; default: random initialisation")
            option(s, "--out", default=None, help="directory to save the DP-ready model to; default: not saved")
        s.set_defaults(fn=fn)
    s = sub.add_parser("cards", help="write the markdown model cards", description="(Re)write the model cards.")
    option(s, "--write", required=True, metavar="DIR", help="directory for one NAME.md per zoo entry (required)")
    s.set_defaults(fn=_cmd_cards)


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command; registries are read now (what a user registered before
    calling :func:`main` is offered), torch is not imported."""
    p = Parser(prog="dpzoo", description="A zoo of differentially-private-ready models.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_model_commands(sub)
    add_train_parser(sub)
    add_eval_parser(sub)
    add_audit_parser(sub)
    return p


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"dpzoo: warning: {message}", file=sys.stderr if file is None else file)


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit code (argparse's errors exit with 2 themselves)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    with warnings.catch_warnings():
        warnings.showwarning = _one_line_warning
        try:
            if getattr(args, "config", None) is not None:  # dpzoo train --config FILE
                args = with_config(parser, argv, args)
            return args.fn(args)
        except DPZooError as e:
            print(f"dpzoo: error: {e}", file=sys.stderr)
            return 2
        except OSError as e:  # a file that cannot be read or written: the user's environment, not a bug
            print(f"dpzoo: error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt as e:
            print(f"dpzoo: {str(e) or 'interrupted'}", file=sys.stderr)
            return 130


def run() -> int:
    """The ``dpzoo`` console script and ``python -m dpzoo``: a process of dpzoo's own, so glibc keeps
    freed memory for reuse first (:func:`dpzoo.cpu_allocator.reuse_freed_memory`; on 2 CPU cores a DP
    step of GPT-2 4×256 took 1.15× of the physical floor with it, 1.33× without: docs/BENCHMARKS.md).
    :func:`main`, which tests and scripts call in their own process, leaves the allocator alone."""
    from ..cpu_allocator import reuse_freed_memory

    reuse_freed_memory()
    return main()


if __name__ == "__main__":
    sys.exit(run())
