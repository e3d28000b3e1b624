"""Refuse ``make_private``'s arguments when they are malformed or would make ε false: the model,
optimizer and data loader passed, and the noise, clipping, batch and seed settings.

Each check raises :class:`~dpzoo.errors.PrivacyUsageError` with the fix; ``make_private`` runs
them in this module's order (model type, optimizer type, settings, loader, the model's layers).
Seeds, which are allowed but make noise or sampling not secret, are warned about
(:func:`warn_seeds`).
"""

from __future__ import annotations

import math
import numbers
import warnings

import torch
from torch import nn
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.utils.data import DataLoader

from ..errors import PrivacyUsageError, ReproducibleNoiseWarning
from ..grad_norms.cost import check_autotune, check_budget
from ..grad_norms.plan import find_problems, refusal
from .caller import first_frame_outside_dpzoo
from .clipping import CLIPPING
from .fsdp import check_fsdp_settings, check_sharding
from .modes import MODES
from .optimizer import DPOptimizer

__all__ = [
    "refuse_engine_options",
    "sample_mixing_modules",
    "check_module",
    "check_optimizer",
    "check_settings",
    "check_loader",
    "check_layers",
    "check_make_private",
    "warn_seeds",
]


def _number(name: str, value, *, positive: bool = False, integer: bool = False, fix: str = "") -> None:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok and integer:
        ok = float(value).is_integer()
    if ok and positive:
        ok = value > 0
    elif ok:
        ok = value >= 0
    if not ok:
        kind = ("a positive integer" if integer else "a finite number > 0") if positive else "a finite number >= 0"
        raise PrivacyUsageError(f"{name} must be {kind}, got {value!r}" + (f": {fix}" if fix else "."))


def sample_mixing_modules(model: nn.Module) -> list[str]:
    """Modules that make one sample's output depend on others in train mode, or whose running
    statistics update from the batch (released without noise): BatchNorm of any kind, with or
    without affine parameters, and instance norms that track running statistics. The
    ``"sample-mixing"`` problems of :func:`dpzoo.grad_norms.find_problems`, as ``"name (Type)"``."""
    out = []
    for problem in find_problems(model, stages=("setup",)):
        if problem.kind == "sample-mixing":
            m = model if problem.module == "<root>" else model.get_submodule(problem.module)
            tracked = ", track_running_stats=True" if isinstance(m, _InstanceNorm) else ""
            out.append(f"{problem.module} ({type(m).__name__}{tracked})")
    return out


def refuse_engine_options(options: dict) -> None:
    """``PrivacyEngine(**options)`` beyond ``accountant``: Opacus' ``secure_mode`` gets its own answer."""
    if "secure_mode" in options:
        raise PrivacyUsageError(
            "secure_mode is Opacus' option: dpzoo always draws noise and Poisson batches from a generator seeded "
            "by OS entropy (secret unless you pass noise_seed/sample_seed), not from torchcsprng; remove it."
        )
    if options:
        raise PrivacyUsageError(
            f"PrivacyEngine got unknown argument(s) {', '.join(sorted(options))}; it takes accountant= only "
            "(the rest goes to make_private)."
        )


def check_module(module) -> None:
    """A plain :class:`torch.nn.Module`, not one wrapped in DistributedDataParallel."""
    if isinstance(module, nn.parallel.DistributedDataParallel):
        raise PrivacyUsageError(
            "Pass the model unwrapped, not in DistributedDataParallel: dpzoo sums the clipped gradients across "
            "ranks itself (DDP would all-reduce non-private gradients). Initialise torch.distributed and call "
            "make_private on each rank."
        )
    if not isinstance(module, nn.Module):
        raise PrivacyUsageError(f"module must be a torch.nn.Module, got {type(module).__name__}.")
    if any(p.is_meta for p in module.parameters()):
        raise PrivacyUsageError(
            "The model's parameters are on the meta device (not materialised): give them values first "
            "(model.to_empty(device='cpu') then load_state_dict, or build the model on a real device)."
        )


def check_optimizer(optimizer) -> None:
    """A plain :class:`torch.optim.Optimizer`, not already a :class:`DPOptimizer`."""
    if isinstance(optimizer, DPOptimizer):
        raise PrivacyUsageError("optimizer is already a dpzoo DPOptimizer: pass the plain torch optimizer.")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise PrivacyUsageError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}.")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise PrivacyUsageError(
            "LBFGS evaluates the loss several times per step (its line search), each a release of the batch that "
            "one noisy step does not account for: use a first-order optimizer (SGD, Adam, AdamW)."
        )


def check_settings(
    *,
    mode: str,
    clipping: str,
    loss_reduction: str,
    noise_multiplier,
    target_epsilon,
    target_delta,
    epochs,
    max_grad_norm,
    max_physical_batch_size,
    self_check_samples,
    noise_seed,
    sample_seed,
    poisson_sampling: bool,
) -> None:
    """The settings ``make_private`` documents: known names, the noise given one way (σ, or a
    target ε with δ and epochs), finite numbers in range, int seeds, Poisson sampling."""
    if mode not in MODES:
        raise PrivacyUsageError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if clipping not in CLIPPING:
        raise PrivacyUsageError(f"clipping must be one of {', '.join(CLIPPING)}, got {clipping!r}")
    if loss_reduction not in ("mean", "sum"):
        raise PrivacyUsageError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
    if (noise_multiplier is None) == (target_epsilon is None):
        raise PrivacyUsageError("Give either noise_multiplier or target_epsilon (with target_delta and epochs).")
    if target_epsilon is not None:
        if target_delta is None or epochs is None:
            raise PrivacyUsageError("target_epsilon needs target_delta and epochs to calibrate the noise.")
        _number("target_epsilon", target_epsilon, positive=True, fix="pass the privacy budget ε, e.g. 8")
        _number("epochs", epochs, positive=True, integer=True, fix="pass how many epochs you will train")
    else:
        _number("noise_multiplier", noise_multiplier, fix="pass σ >= 0 (0 means no privacy)")
    if target_delta is not None and not (isinstance(target_delta, numbers.Real) and 0 < target_delta < 1):
        raise PrivacyUsageError(f"target_delta must be in (0, 1), got {target_delta!r}: use δ < 1/N, e.g. 1e-5.")
    _number("max_grad_norm", max_grad_norm, positive=True, fix="pass the clipping bound R, e.g. 1.0")
    if max_physical_batch_size is not None and not isinstance(max_physical_batch_size, numbers.Integral):
        raise PrivacyUsageError(f"max_physical_batch_size must be a positive integer, got {max_physical_batch_size!r}.")
    if max_physical_batch_size is not None:
        _number(
            "max_physical_batch_size",
            max_physical_batch_size,
            positive=True,
            integer=True,
            fix="pass the largest micro-batch that fits in memory, or None for no splitting",
        )
    _number("self_check_samples", self_check_samples, positive=True, integer=True)
    for name, seed in (("noise_seed", noise_seed), ("sample_seed", sample_seed)):
        if seed is not None and (not isinstance(seed, numbers.Integral) or isinstance(seed, bool)):
            raise PrivacyUsageError(f"{name} must be an int or None (the default: secret), got {seed!r}.")
    if not poisson_sampling:
        raise PrivacyUsageError(
            "poisson_sampling=False is refused: dpzoo accounts DP-SGD as Poisson-subsampled, and the ε of fixed or "
            "shuffled batches is not that (nor simply bounded under add/remove adjacency). Keep "
            "poisson_sampling=True; use max_physical_batch_size to bound memory."
        )


def check_loader(data_loader) -> int:
    """A data loader with a dataset and a fixed ``batch_size``; returns that batch size (the
    expected logical batch size of the Poisson-sampling loader that replaces it)."""
    if not isinstance(data_loader, DataLoader) and not hasattr(data_loader, "dataset"):
        raise PrivacyUsageError(f"data_loader must be a torch DataLoader, got {type(data_loader).__name__}.")
    if isinstance(getattr(data_loader, "dataset", None), torch.utils.data.IterableDataset):
        raise PrivacyUsageError(
            "Poisson sampling draws each sample by its index: make_private needs a map-style dataset (__len__ and "
            "__getitem__), not an IterableDataset."
        )
    batch_size = getattr(data_loader, "batch_size", None)
    if batch_size is None:
        raise PrivacyUsageError(
            "The data loader needs a fixed batch_size (no batch_sampler): it sets the expected Poisson batch size."
        )
    if len(data_loader.dataset) < 1:
        raise PrivacyUsageError("The data loader's dataset is empty.")
    return batch_size


def check_layers(module: nn.Module) -> None:
    """No layer dpzoo cannot clip or that leaks the batch: the ``"setup"`` problems of
    :func:`dpzoo.grad_norms.find_problems` (lazy, uninitialised parameters; embeddings with any
    ``max_norm``, 0 included; modules that mix samples, :func:`sample_mixing_modules`), the same
    list ``dpzoo.check_dp_ready`` prints."""
    problems = find_problems(module, stages=("setup",))
    if problems:
        raise PrivacyUsageError(refusal(problems))


def warn_seeds(noise_seed: int | None, sample_seed: int | None) -> None:
    """A :class:`~dpzoo.errors.ReproducibleNoiseWarning` for each seed given (they make noise or
    sampling reproducible, hence not secret), pointed at the caller of ``make_private``."""
    for name, seed in (("noise_seed", noise_seed), ("sample_seed", sample_seed)):
        if seed is not None:
            warnings.warn(
                f"{name}={seed}: {'noise' if name == 'noise_seed' else 'Poisson membership'} is "
                "reproducible, so it is not secret: the guarantee does not hold against anyone who "
                "holds the seed. Leave it None outside tests.",
                ReproducibleNoiseWarning,
                stacklevel=first_frame_outside_dpzoo(),
            )


def check_make_private(module, optimizer, data_loader, given: dict) -> tuple[bool, int]:
    """Step 1 of :meth:`~dpzoo.PrivacyEngine.make_private` (``given``: its arguments): refuse what
    is malformed or would make ε false. Returns (whether the module is FSDP2-sharded, the batch size)."""
    check_module(module)
    sharded = check_sharding(module)  # FSDP2 (dpzoo.privacy.fsdp); FSDP1, tensor parallel, HSDP refused
    if sharded:
        check_fsdp_settings(max_physical_batch_size=given["max_physical_batch_size"], self_check=given["self_check"])
    check_optimizer(optimizer)
    check_settings(**{k: given[k] for k in SETTINGS})
    check_budget(given["memory_budget"]), check_autotune(given["autotune"])
    batch_size = check_loader(data_loader)
    check_layers(module)
    return sharded, batch_size


SETTINGS = ("mode", "clipping", "loss_reduction", "noise_multiplier", "target_epsilon", "target_delta", "epochs",
            "max_grad_norm", "max_physical_batch_size", "self_check_samples", "noise_seed", "sample_seed",
            "poisson_sampling")  # fmt: skip
