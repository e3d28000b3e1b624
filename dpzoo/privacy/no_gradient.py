"""The warning for a trainable parameter no sample's gradient reached in a whole logical step."""

from __future__ import annotations

import pathlib
import warnings

import torch

from ..errors import NoGradientWarning
from .caller import first_frame_outside_dpzoo

__all__ = ["warn_no_gradient"]

TORCH_OPTIM_DIR = str(pathlib.Path(torch.optim.__file__).resolve().parent)


def warn_no_gradient(warned: set[str], names: list[str], samples: int) -> None:
    """Once per parameter (``warned`` keeps those already named): trainable, yet no sample of a whole
    logical step of ``samples`` reached it (unused in forward, or its path detached). Still private
    (it gets noise), but almost always a bug that stops it learning."""
    if not (new := [n for n in names if n not in warned]):
        return
    warned.update(new)
    shown = ", ".join(new[:8]) + (f" and {len(new) - 8} more" if len(new) > 8 else "")
    warnings.warn(
        f"Trainable parameter(s) {shown} received no gradient in a DP step of {samples} "
        "samples: they are moved by noise only. If they are not meant to train, freeze them "
        "(requires_grad_(False)) before make_private; if they are, check that the forward pass uses them "
        "and does not detach their path (e.g. a result reassigned under torch.no_grad()).",
        NoGradientWarning,
        stacklevel=first_frame_outside_dpzoo(also=(TORCH_OPTIM_DIR,)),  # the line that called opt.step()
    )
