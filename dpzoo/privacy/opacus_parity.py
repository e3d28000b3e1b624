"""Opacus' ``PrivacyEngine`` spellings on dpzoo's engine: ``make_private_with_epsilon`` and the
Opacus-only arguments of ``make_private``, each mapped where dpzoo's meaning is identical and
refused (a :class:`~dpzoo.errors.PrivacyUsageError` naming the fix) where dpzoo cannot honour it.

Code written for Opacus 1.6 runs unchanged::

    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=loader, target_epsilon=8,
        target_delta=1e-5, epochs=3, max_grad_norm=1.0)          # Opacus' keywords, dpzoo's engine

The Opacus-only arguments (:data:`OPACUS_ARGUMENTS`) and what dpzoo does with each:

* ``clipping="flat"`` → ``"abadi"``: both clip the flat per-sample norm by min(1, R/‖g_i‖).
  ``"per_layer"`` and ``"adaptive"`` (and a list of per-layer ``max_grad_norm``) are refused:
  dpzoo clips the whole per-sample gradient by one fixed R (``"automatic"`` is its other choice).
* ``grad_sample_mode="hooks"`` → ``mode="instantiate"`` (per-sample gradients materialised),
  ``"ghost"`` → ``mode="bk"`` (ghost norm, BK paper eq. 2; one backward instead of Opacus' two).
  Either way the DP update is the same function of the batch; only memory and speed differ. With
  ``"ghost"`` the call returns four values like Opacus' (model, optimizer, criterion, loader); the
  criterion is yours, unchanged: dpzoo needs no second backward pass. Omitted, dpzoo's ``mode``
  (default ``"auto"``) applies. ``"functorch"``, ``"ew"`` and the FSDP modes are refused.
* ``criterion``: only used for ``"ghost"``'s return value (Opacus' default: ``CrossEntropyLoss()``).
* ``batch_first=True`` is what dpzoo requires (it clips dimension 0); ``False`` is refused.
* ``noise_generator`` (a ``torch.Generator``) is refused: dpzoo draws noise from fresh OS entropy,
  or, for tests, from ``noise_seed=<int>`` (recorded in the metadata as reproducible).
* ``wrap_model=True`` is accepted: dpzoo never wraps, the returned model is yours with hooks
  attached (``engine.detach()`` removes them). ``False`` (which makes Opacus return a hooks
  handle instead of the model) is refused.
* ``rand_on_empty`` is accepted and has nothing to do: dpzoo's loader never yields an empty
  batch (the engine takes the noise-only step of an empty Poisson batch itself).
* ``epsilon_tolerance`` (``make_private_with_epsilon``) is accepted: dpzoo's calibrated σ always
  has ε ≤ ``target_epsilon``, within 0.01 of it, as Opacus' default tolerance.
* ``poisson_sampling=False`` is refused by ``make_private`` itself (the ε would be false).

Where dpzoo differs on purpose: the sample rate is ``batch_size / len(dataset)`` (Opacus:
``1 / len(data_loader)``, the same when ``batch_size`` divides the dataset), and σ is calibrated
*after* what the model or the accountant already spent (Opacus warns and ignores it).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, TypeVar, cast

from torch import nn

from ..errors import PrivacyUsageError

__all__ = ["OpacusParity", "opacus_arguments", "translate_opacus_arguments", "OPACUS_ARGUMENTS", "GRAD_SAMPLE_MODES"]

F = TypeVar("F", bound=Callable[..., Any])

# Opacus' grad_sample_mode -> dpzoo's mode of the same DP update
GRAD_SAMPLE_MODES = {"hooks": "instantiate", "ghost": "bk"}
# Opacus' make_private / make_private_with_epsilon arguments that dpzoo's make_private lacks
OPACUS_ARGUMENTS = (
    "criterion",
    "batch_first",
    "noise_generator",
    "grad_sample_mode",
    "wrap_model",
    "rand_on_empty",
    "epsilon_tolerance",
)


def translate_opacus_arguments(kwargs: dict[str, Any], accepted: set[str]) -> tuple[bool, Any]:
    """Rewrite Opacus' spellings in ``kwargs`` (``make_private``'s keyword arguments) into dpzoo's,
    in place; refuse what dpzoo cannot honour or does not know (``accepted``: dpzoo's names).
    Returns (Opacus would return a criterion too, that criterion)."""
    criterion = kwargs.pop("criterion", None)
    kwargs.pop("rand_on_empty", None)  # dpzoo never yields an empty batch
    kwargs.pop("epsilon_tolerance", None)  # dpzoo's σ: ε <= target, within 0.01 of it
    if kwargs.pop("batch_first", True) is not True:
        raise PrivacyUsageError(
            "batch_first=False is refused: dpzoo clips dimension 0 of the model's input as the batch. Pass "
            "batch-first inputs (e.g. transpose a (T, B, ...) batch in the collate_fn) and drop batch_first."
        )
    if kwargs.pop("noise_generator", None) is not None:
        raise PrivacyUsageError(
            "noise_generator is refused: dpzoo draws each step's noise from fresh OS entropy (secret). For a "
            "reproducible test pass noise_seed=<int> instead (recorded in the privacy metadata as not secret)."
        )
    if kwargs.pop("wrap_model", True) is not True:
        raise PrivacyUsageError(
            "wrap_model=False is refused: dpzoo never wraps the model, it returns your model with hooks attached "
            "(engine.detach() removes them), so there is no hooks handle to return. Drop wrap_model."
        )
    clipping = kwargs.get("clipping")
    if clipping == "flat":
        kwargs["clipping"] = "abadi"  # the same function: min(1, R / ||g_i||) on the flat norm
    elif clipping in ("per_layer", "adaptive"):
        raise PrivacyUsageError(
            f"clipping={clipping!r} is refused: dpzoo clips each sample's whole gradient by one fixed "
            "max_grad_norm. Use clipping='flat' (= 'abadi') or 'automatic'."
        )
    if isinstance(kwargs.get("max_grad_norm"), (list, tuple)):
        raise PrivacyUsageError(
            "A list of max_grad_norm (Opacus' per-layer clipping) is refused: dpzoo clips each sample's whole "
            "gradient by one bound. Pass one number, e.g. max_grad_norm=1.0."
        )
    grad_sample_mode = kwargs.pop("grad_sample_mode", None)
    ghost = grad_sample_mode == "ghost"
    if grad_sample_mode is not None:
        if grad_sample_mode not in GRAD_SAMPLE_MODES:
            raise PrivacyUsageError(
                f"grad_sample_mode={grad_sample_mode!r} is refused: dpzoo computes per-sample norms with its "
                "own hooks. Use 'hooks' (= mode='instantiate'), 'ghost' (= mode='bk'), or drop it and pick "
                "dpzoo's mode= ('auto' by default)."
            )
        mode = GRAD_SAMPLE_MODES[grad_sample_mode]
        if kwargs.get("mode", mode) != mode:
            raise PrivacyUsageError(
                f"grad_sample_mode={grad_sample_mode!r} (= mode={mode!r}) contradicts mode={kwargs['mode']!r}: "
                "pass only one of them."
            )
        kwargs["mode"] = mode
    if "accountant" in kwargs:
        raise PrivacyUsageError(
            "make_private(accountant=...): the accountant belongs to the engine, "
            f"dpzoo.PrivacyEngine(accountant={kwargs['accountant']!r})."
        )
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise PrivacyUsageError(
            f"make_private got argument(s) {', '.join(unknown)} that dpzoo does not know (nor maps from Opacus): "
            f"remove them. dpzoo's arguments: {', '.join(sorted(accepted))}."
        )
    if ghost and criterion is None:
        criterion = nn.CrossEntropyLoss()  # Opacus' default criterion
    return ghost, criterion


def opacus_arguments(make_private: F) -> F:
    """Decorates ``PrivacyEngine.make_private`` so it also takes Opacus' spellings
    (:func:`translate_opacus_arguments`); with ``grad_sample_mode="ghost"`` it returns
    (model, optimizer, criterion, loader) as Opacus does."""
    accepted = {n for n in inspect.signature(make_private).parameters if n != "self"}

    @functools.wraps(make_private)
    def wrapper(self, **kwargs):
        ghost, criterion = translate_opacus_arguments(kwargs, accepted)
        module, optimizer, loader = make_private(self, **kwargs)
        return (module, optimizer, criterion, loader) if ghost else (module, optimizer, loader)

    return cast(F, wrapper)


class OpacusParity:
    """Opacus 1.6's ``PrivacyEngine`` methods dpzoo's :class:`~dpzoo.PrivacyEngine` also has."""

    def make_private_with_epsilon(
        self,
        *,
        module: nn.Module,
        optimizer,
        criterion=None,
        data_loader,
        target_epsilon: float,
        target_delta: float,
        epochs: int,
        max_grad_norm: float,
        batch_first: bool = True,
        loss_reduction: str = "mean",
        poisson_sampling: bool = True,
        clipping: str = "flat",
        noise_generator=None,
        grad_sample_mode: str | None = None,
        wrap_model: bool = True,
        **kwargs,
    ):
        """Opacus' ``make_private_with_epsilon``, same arguments: σ is calibrated so that
        ``epochs`` epochs of the returned loader spend at most ``target_epsilon`` at
        ``target_delta`` (composed after any privacy the model already spent). Delegates to
        ``make_private(target_epsilon=...)``; Opacus-only arguments are mapped or refused as the
        module docstring lists; dpzoo's own (``mode``, ``max_physical_batch_size``, ``noise_seed``,
        ...) pass through. Returns (model, optimizer, loader), or with ``grad_sample_mode="ghost"``
        (model, optimizer, criterion, loader)."""
        if "noise_multiplier" in kwargs:
            raise PrivacyUsageError(
                "make_private_with_epsilon calibrates the noise to target_epsilon: drop noise_multiplier, or call "
                "make_private(noise_multiplier=...) without a target."
            )
        engine: Any = self  # a PrivacyEngine, which inherits this class and defines make_private
        return engine.make_private(
            module=module,
            optimizer=optimizer,
            criterion=criterion,
            data_loader=data_loader,
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            epochs=epochs,
            max_grad_norm=max_grad_norm,
            batch_first=batch_first,
            loss_reduction=loss_reduction,
            poisson_sampling=poisson_sampling,
            clipping=clipping,
            noise_generator=noise_generator,
            grad_sample_mode=grad_sample_mode,
            wrap_model=wrap_model,
            **kwargs,
        )
