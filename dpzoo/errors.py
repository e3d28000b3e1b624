"""Exceptions dpzoo raises for a user's mistake.

Each message says what was wrong and how to fix it, so a user never has to read a
stack trace from deep inside torch, timm or transformers.
"""

from __future__ import annotations

import difflib
from typing import Iterable


class DPZooError(Exception):
    """Base class of every error dpzoo raises on purpose."""


class UnknownModelError(DPZooError, KeyError):
    """A model name that is not in the zoo."""

    def __init__(self, name: str, known: Iterable[str]):
        known = sorted(known)
        close = difflib.get_close_matches(name, known, n=5, cutoff=0.4)
        if not close:  # fall back to a substring match ("resnet" -> all resnets)
            close = [k for k in known if name.lower() in k.lower()][:5]
        msg = f"Unknown model {name!r}."
        if close:
            msg += " Did you mean: " + ", ".join(close) + "?"
        msg += " `dpzoo.list_models()` (or `dpzoo list`) lists all names."
        self.name, self.suggestions = name, close
        super().__init__(msg)

    def __str__(self) -> str:  # KeyError would wrap the message in quotes
        return self.args[0]


class OverrideError(DPZooError, TypeError):
    """An override (keyword argument) a zoo entry does not accept, or a bad value."""


class CheckpointError(DPZooError):
    """A checkpoint that cannot be read or does not fit the architecture."""


class PatchError(DPZooError):
    """Model surgery that cannot be applied as asked (e.g. a GroupNorm group count)."""


class SaveError(DPZooError):
    """A model or directory that `dpzoo.save` / `dpzoo.load(dir)` cannot handle."""


class UnsupportedModuleError(DPZooError):
    """A trainable parameter whose per-sample gradient dpzoo cannot account for.

    Raised instead of silently leaving the parameter unclipped (a privacy leak).
    """


class NoGradientWarning(UserWarning):
    """A trainable parameter got no gradient in a whole DP step: it is moved by noise only."""


class AccountingError(DPZooError, ValueError):
    """A privacy-accounting request dpzoo refuses rather than answer with a wrong ε: a bad
    argument (ε, δ, sample rate, steps, noise multiplier, accountant name) or an accountant
    that cannot compose the recorded history (``"gdp"`` with more than one (σ, q)).

    A ``ValueError`` too, so code that caught the plain ``ValueError`` of older dpzoo still works.
    """


class SelfCheckError(DPZooError):
    """dpzoo's per-sample gradients disagree with single-sample backward passes on this model
    (:func:`dpzoo.verify`, the engine's first-step self-check): training would clip the wrong
    quantities, so it is refused."""


class PrivacyUsageError(DPZooError, ValueError):
    """A use of the DP engine whose reported ε would be false (wrong batches, parameters outside
    the model, samples mixed or counted twice), or an invalid argument of it."""


class LossMixingError(PrivacyUsageError):
    """The loss computed from the model's outputs makes one sample's gradient depend on other
    samples (a mean over the batch's tokens or class weights, in-batch negatives, a batch
    statistic): the clipped sum's sensitivity would exceed R."""


class WeakPrivacyWarning(UserWarning):
    """A privacy budget that says little: no noise (ε = ∞), a target ε of 100 or more, or training
    past the steps the noise was calibrated for (ε above the target)."""


class UntestedVersionWarning(UserWarning):
    """torch or transformers is outside the range dpzoo's exactness suites were run on
    (``dpzoo.versions.TESTED``): dpzoo relies on their autograd and module internals, so the
    first-step self-check is then the only evidence that per-sample gradients are exact."""


class ReproducibleNoiseWarning(UserWarning):
    """Noise or Poisson sampling was seeded by the user: anyone holding the seed can subtract the
    noise, so the guarantee holds only against those who do not."""


class UnsupportedBatchError(DPZooError, TypeError):
    """A dataset item or collated batch whose type the DP data loader cannot count rows of or
    build an empty batch from. A ``TypeError`` too, as it was before it had its own class."""


class InvalidArgumentError(DPZooError, ValueError):
    """An argument dpzoo cannot use: out of range, not one of the accepted choices, a tensor of
    the wrong shape, or a name already taken in a registry.

    A ``ValueError`` too, so code that caught the plain ``ValueError`` of older dpzoo still works.
    """


class MissingDependencyError(DPZooError, ImportError):
    """An optional package a feature needs is not installed; the message names the pip command.

    An ``ImportError`` too, so code that caught the plain ``ImportError`` still works.
    """
