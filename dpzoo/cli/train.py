"""``dpzoo train``: its options, their checks against the model, and the run (or its resumption).

Values are checked when parsed (:mod:`dpzoo.cli.args`); what depends on the model is checked
here before anything is loaded: an option that does not apply to the model's kind (``--max-len``
for an image classifier, ``--full-size`` for a sequence model, privacy options with
``--non-private``) is refused, never ignored, and ``--out`` must be new or empty
(``--overwrite``) and writable. ``--resume DIR`` continues an interrupted run with the settings
saved in its checkpoint, so its ε is the one the uninterrupted run would report. torch is
imported only when a command runs, not when the parser is built.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..errors import InvalidArgumentError
from .args import (
    given,
    option,
)
from .choices import (
    datasets_help,
    max_len_help,
    trainable_models_help,
)
from .common_options import add_budget_options, add_privacy_options, add_run_options
from .image import (
    add_image_options,
    check_image_options,
    check_table_options,
    check_text_options,
    image_choices,
    text_choices,
)
from .kinds import (
    CLASSIFIER_KINDS,
    DEFAULT_DATA,
    DEFAULT_EVAL_EVERY,
    DEFAULT_STEPS,
    KIND_ONLY,
    KIND_PLURALS,
    KIND_WORDS,
    model_kind,
)
from .seqrec import add_seqrec_options

__all__ = ["add_train_parser", "cmd_train"]

PRIVACY_OPTIONS = {
    "epsilon": "--epsilon",
    "delta": "--delta",
    "accountant": "--accountant",
    "clipping": "--clipping",
    "max_grad_norm": "--max-grad-norm",
    "mode": "--mode",
    "max_physical_batch_size": "--max-physical-batch-size",
    "noise_seed": "--noise-seed",
    "sample_seed": "--sample-seed",
}
# what --resume may be given with (the rest is the checkpoint's)
RESUME_OPTIONS = {"resume", "name", "quiet", "checkpoint_every", "device", "config"}
# modes for models `dpzoo train` does not build: LoRA needs a PEFT model (dpzoo.integrations.peft)
PEFT_MODES = {"lora"}


def add_train_parser(sub) -> None:
    """The ``train`` subcommand and its options (registries read now, torch not imported)."""
    s = sub.add_parser(
        "train",
        help="private training of a zoo model on a built-in dataset",
        description="Train a zoo model with DP-SGD (dpzoo's engine) and save it with its privacy metadata.",
    )
    s.add_argument("name", nargs="?", metavar="NAME", help=f"the zoo model to train: {trainable_models_help()}")
    option(
        s,
        "--data",
        default=None,
        help="image models: digits (bundled with scikit-learn; the default) or an image folder (ROOT/<class>/"
        "<image>, or ROOT/train/ and ROOT/val/); tabular models: digits (64 features; the default) or a .csv or "
        ".parquet file (see --label-column); sequence models: synthetic (the "
        f"default), {datasets_help()} or a file path (dpzoo.seqrec.register_dataset adds names)",
    )
    add_budget_options(s)
    add_privacy_options(s)
    add_image_options(s)
    add_seqrec_options(s, max_len_help())
    add_run_options(s)
    s.set_defaults(fn=cmd_train)


def _check_options(kind: str, args: argparse.Namespace, opts: set[str]) -> None:
    for dest, (flag, kinds) in KIND_ONLY.items():
        if dest in opts and kind not in kinds:
            raise InvalidArgumentError(
                f"{flag} is for {' and '.join(KIND_PLURALS[k] for k in kinds)}; {args.name} is {KIND_WORDS[kind]}."
            )
    if args.mode in PEFT_MODES:
        raise InvalidArgumentError(
            f"--mode {args.mode} trains the adapters of a PEFT model, and dpzoo train builds {args.name} without "
            "any: choose another mode (or train a PEFT model from Python, dpzoo.integrations.peft)."
        )
    if args.non_private:
        private = sorted(PRIVACY_OPTIONS[d] for d in opts & set(PRIVACY_OPTIONS))
        if private:
            verb = "does" if len(private) == 1 else "do"
            raise InvalidArgumentError(f"{', '.join(private)} {verb} not apply with --non-private (no DP at all).")
    if args.out is None:
        needs_out = sorted(
            {"overwrite": "--overwrite", "checkpoint_every": "--checkpoint-every"}[d]
            for d in opts & {"overwrite", "checkpoint_every"}
        )
        if needs_out:
            verb = "needs" if len(needs_out) == 1 else "need"
            raise InvalidArgumentError(f"{', '.join(needs_out)} {verb} --out DIR (where the run is saved).")
    data = args.data or DEFAULT_DATA[kind]
    if kind == "image":
        return check_image_options(args, data)
    if kind == "tabular":
        return check_table_options(args, data)
    if kind == "text":
        return check_text_options(args, data)
    from ..seqrec.downloads import DATASETS

    if data in DATASETS or data == "synthetic":
        return
    if data == "digits":
        raise InvalidArgumentError(f"--data digits is for image classifiers; {args.name} is a sequence model.")
    if not os.path.isfile(data):
        raise InvalidArgumentError(
            f"--data {data!r} is neither a dataset ({', '.join(['synthetic', *DATASETS])}) nor an existing file."
        )
    if not os.access(data, os.R_OK):
        raise InvalidArgumentError(f"--data {data!r} cannot be read (permissions).")


def default_image_size(name: str, data: str) -> int:
    """The pixels images are resized to without ``--image-size``: the entry's recipe (its card's
    ``train_defaults``) if it names a size, else 16 for the digits and 32 for an image folder."""
    from ..models import model_card  # (lazily, as _recipe: the CLI's help stays free of the zoo)

    return int(model_card(name).train_defaults.get("image_size") or (16 if data == "digits" else 32))


def _train_kwargs(kind: str, args: argparse.Namespace) -> dict:
    common = {
        "data": args.data or DEFAULT_DATA[kind],
        "epsilon": args.epsilon,
        **{k: v if getattr(args, k) is None else getattr(args, k) for k, v in _recipe(kind, args.name).items()},
        "mode": args.mode,
        "clipping": args.clipping,
        "max_grad_norm": args.max_grad_norm,
        "accountant": args.accountant,
        "overrides": dict(args.set or []),
        "seed": args.seed,
        "max_physical_batch_size": args.max_physical_batch_size,
        "eval_every": args.eval_every or DEFAULT_EVAL_EVERY[kind],
        "noise_seed": args.noise_seed,
        "sample_seed": args.sample_seed,
    }
    if kind in CLASSIFIER_KINDS:
        common.pop("image_size", None)  # the recipe's, when it has one: default_image_size
        size = args.image_size or default_image_size(args.name, common["data"])
        return {
            **common,
            **image_choices(args),
            **({"weight_decay": args.weight_decay} if args.weight_decay is not None else {}),
            "delta": args.delta if args.delta is not None else 1e-5,
            **({"small": not args.full_size, "image_size": size} if kind == "image" else {}),
            **({"text": text_choices(args)} if kind == "text" else {}),
        }
    return {
        **common,
        "delta": args.delta,
        "max_len": args.max_len,
        "private": not args.non_private,
        "amazon_columns": args.amazon_columns,
        # "auto" by default: the largest micro-batch the memory holds (a full softmax over V items)
        "max_physical_batch_size": "auto" if args.max_physical_batch_size is None else args.max_physical_batch_size,
        **({"weight_decay": args.weight_decay} if args.weight_decay is not None else {}),
        **({"item_prior": args.item_prior} if args.item_prior is not None else {}),
        **({"item_prior_noise": args.item_prior_noise} if args.item_prior_noise is not None else {}),
    }


def _recipe(kind: str, name: str) -> dict[str, Any]:
    """Epochs, batch size and learning rate: the entry's own recipe (its card's train_defaults) over
    the defaults of its kind."""
    from ..models import model_card

    return {**DEFAULT_STEPS[kind], **model_card(name).train_defaults}


def _resume_kwargs(args: argparse.Namespace, opts: set[str]) -> tuple[str, dict]:
    from ..runs.files import load_checkpoint

    extra = sorted(opts - RESUME_OPTIONS)
    if extra:
        flags = ", ".join("--" + d.replace("_", "-") for d in extra)
        raise InvalidArgumentError(
            f"--resume continues the run with the settings it started with: drop {flags} "
            "(start a new run in another --out to change them)."
        )
    checkpoint = load_checkpoint(args.resume, mmap=True)
    settings = dict(checkpoint["settings"])
    kind = settings.pop("kind")
    if args.name is not None and args.name != settings["name"]:
        raise InvalidArgumentError(f"--resume {args.resume} is a run of {settings['name']}, not {args.name}.")
    device = args.device if "device" in opts else checkpoint.get("device", "cpu")
    return kind, {**settings, "device": device, "resume": args.resume}


def cmd_train(args: argparse.Namespace) -> int:
    """Check the options against the model, then train (or resume); 0 when the run completes."""
    opts = given(args)
    if args.resume is not None:
        kind, kwargs = _resume_kwargs(args, opts)
    else:
        if args.name is None:
            raise InvalidArgumentError("dpzoo train needs a model NAME (or --resume DIR); `dpzoo list` lists the zoo.")
        kind = model_kind(args.name)
        _check_options(kind, args, opts)
        kwargs = {
            "name": args.name,
            **_train_kwargs(kind, args),
            "device": args.device,
            "out": args.out,
            "overwrite": args.overwrite,
        }
    kwargs.update(
        checkpoint_every=args.checkpoint_every,
        progress=False if args.quiet else None,
        log=(lambda message: None) if args.quiet else (lambda message: print(message, flush=True)),
        handle_sigint=True,
    )
    from ..runs.files import no_empty_out_left

    with no_empty_out_left(kwargs.get("out")):
        if kind in CLASSIFIER_KINDS:
            from ..runs.classifier import train_image_classifier

            result = train_image_classifier(**kwargs)
        else:
            from ..seqrec.train import train_seqrec

            result = train_seqrec(**kwargs)
    if args.quiet:
        last = result["history"][-1] if result["history"] else {}
        metric = {k: v for k, v in last.items() if k.startswith("test_")}
        eps = (
            f"ε = {result['epsilon']:.3g} at δ = {result['delta']:.3g}"
            if result.get("epsilon") is not None
            else "non-private"
        )
        shown = ", ".join(f"{k} {v:.4g}" for k, v in metric.items())
        print(f"{result['model']}: {result['steps']} steps, {eps}, {shown}")
    return 0
