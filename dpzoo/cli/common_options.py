"""The options of ``dpzoo train`` that every kind of model takes: the budget and the recipe, the
mechanism, and the run's files (:func:`dpzoo.cli.train.add_train_parser` adds them in this order,
then the options of single kinds: :mod:`dpzoo.cli.image`, :mod:`dpzoo.cli.seqrec`)."""

from __future__ import annotations

from .args import (
    checkpoint_every,
    key_value,
    nonnegative_float,
    nonnegative_int,
    option,
    physical_batch_size,
    positive_float,
    positive_int,
    unit_interval,
)
from .choices import DEFAULT_CLI_MODE, mode_names, modes_help, usable_accountants
from .config import add_config_option

__all__ = ["add_budget_options", "add_privacy_options", "add_run_options", "add_accountant_option"]


def add_budget_options(s) -> None:
    """ε, δ and the recipe: epochs, batch size, learning rate, evaluations."""
    option(s, "--epsilon", type=positive_float, default=8.0, help="the privacy budget ε the noise is calibrated to")
    option(
        s,
        "--delta",
        type=unit_interval,
        default=None,
        help="δ of the (ε, δ) guarantee (default: 1e-5 for images, N^-1.1 for N users of sequence data)",
    )
    option(
        s,
        "--eval-every",
        type=positive_int,
        default=None,
        help="evaluate every k epochs and after the last (default: 1 for images, 5 for sequence models)",
    )
    option(
        s,
        "--max-physical-batch-size",
        type=physical_batch_size,
        default=None,
        metavar="N|auto",
        help="split each Poisson batch into micro-batches of at most N samples, or auto: the largest whose "
        "estimated peak memory fits in half of the training device's available memory (memory and time only: "
        "one DP step per batch); default: auto for sequence models, whole batches for image classifiers",
    )
    option(
        s,
        "--epochs",
        type=positive_int,
        default=None,
        help="passes over the data (each len(data)/batch steps); default: the model card's recipe if it has one, else 10 for images, 20 for sequence models",
    )
    option(
        s,
        "--batch-size",
        type=positive_int,
        default=None,
        help="expected batch size: Poisson sampling at rate batch/N; default: the model card's recipe if it has one, else 64 for images, for sequence models "
        "1024 or a quarter of the users if fewer",
    )
    option(
        s,
        "--lr",
        type=positive_float,
        default=None,
        help="Adam's learning rate; default: the model card's recipe if it has one, else 2e-3 for images, 1e-2 for sequence models",
    )
    option(
        s,
        "--weight-decay",
        type=nonnegative_float,
        default=None,
        help="the optimizer's weight decay (post-processing: it keeps ε); default: 0 for images, 1e-5 for sequence "
        "models",
    )


def add_privacy_options(s) -> None:
    """The mechanism (mode, clipping, R, accountant), the model's overrides, seeds and the device."""
    option(s, "--mode", default=DEFAULT_CLI_MODE, choices=mode_names(), help=f"training mode: {modes_help()}")
    option(
        s,
        "--clipping",
        default="automatic",
        choices=["automatic", "abadi"],
        help="per-sample clipping: automatic (normalise each gradient) or abadi (clip to --max-grad-norm)",
    )
    option(s, "--max-grad-norm", type=positive_float, default=1.0, help="the clipping bound R of each sample")
    add_accountant_option(s)
    option(
        s,
        "--set",
        kind="append",
        type=key_value,
        metavar="KEY=VALUE",
        help="a model override, repeatable, VALUE read as JSON (e.g. --set width=16); none by default",
    )
    option(
        s,
        "--seed",
        type=nonnegative_int,
        default=0,
        help="fixes the initialisation, the data split and the synthetic data (sampling and noise stay secret)",
    )
    for what in ("noise", "sample"):
        option(
            s,
            f"--{what}-seed",
            type=nonnegative_int,
            default=None,
            help=f"tests only: makes the {'noise' if what == 'noise' else 'Poisson sampling'} reproducible, so "
            "anyone with the seed can undo the privacy (recorded in the metadata); default: secret (OS entropy)",
        )
    option(s, "--device", default="cpu", help="where the model trains: cpu, cuda, cuda:1, mps")


def add_run_options(s) -> None:
    """Where the run writes, how it checkpoints and resumes, and how much it says."""
    option(
        s,
        "--out",
        default=None,
        metavar="DIR",
        help="a new or empty directory for the run: metrics.csv (each evaluation), checkpoint.pt, tensorboard/ "
        "(with tensorboard installed), then metrics.json, metrics.png and model/; default: nothing saved",
    )
    option(s, "--overwrite", kind="flag", help="replace an earlier run's results in --out (default: refuse)")
    add_config_option(s)
    option(
        s,
        "--checkpoint-every",
        type=checkpoint_every,
        default="epoch",
        metavar="N|epoch|off",
        help="save checkpoint.pt in --out every N steps, after every epoch, or not at all (Ctrl-C saves one too)",
    )
    option(
        s,
        "--resume",
        default=None,
        metavar="DIR",
        help="continue the interrupted run whose --out is DIR, with its saved settings and ε bookkeeping; "
        "default: a new run",
    )
    option(
        s,
        "--quiet",
        kind="flag",
        help="no progress bar and no per-evaluation lines, only the final line (default: both, on a terminal)",
    )


def add_accountant_option(s) -> None:
    """``--accountant``, as ``dpzoo train`` and ``dpzoo audit`` take it."""
    option(
        s,
        "--accountant",
        default="rdp",
        choices=usable_accountants(),
        help="a registered accountant whose ε is an upper bound (dpzoo.register_accountant adds one)",
    )
