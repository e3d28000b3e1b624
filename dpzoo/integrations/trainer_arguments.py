"""The privacy settings of :class:`~dpzoo.integrations.transformers.DPTrainer` (:class:`DPArguments`)
and the refusal of Trainer settings under which the reported ε would be false.

:class:`DPArguments` is a dataclass, so ``transformers.HfArgumentParser((TrainingArguments,
DPArguments))`` reads both from a command line; its names do not clash with
``TrainingArguments``' (the per-sample clipping bound is ``per_sample_max_grad_norm``, as in
dp-transformers, because ``TrainingArguments.max_grad_norm`` is the Trainer's own, non-private
clipping of the summed gradient).
"""

from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import dataclass, field

import torch

from ..errors import PrivacyUsageError
from ..privacy import CLIPPING, MODES

__all__ = ["DPArguments", "check_trainer_settings", "check_batch_fits", "total_steps"]

TOKEN_REDUCTIONS = ("mean", "sum")


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class DPArguments:
    """How :class:`~dpzoo.integrations.transformers.DPTrainer` makes the run private.

    The noise is given one way: ``target_epsilon`` (σ is calibrated so the whole run — every
    epoch of ``num_train_epochs``, or ``max_steps`` — spends it, after any privacy the model
    already spent) or ``noise_multiplier``. ``target_delta`` is needed either way, to report ε.
    The expected logical batch (one noise draw) is ``per_device_train_batch_size ×
    gradient_accumulation_steps``; ``max_physical_batch_size`` bounds each forward pass.
    """

    target_epsilon: float | None = field(default=None, metadata=_help("privacy budget ε of the whole run"))
    target_delta: float | None = field(default=None, metadata=_help("δ of the guarantee; use δ < 1/N"))
    noise_multiplier: float | None = field(default=None, metadata=_help("σ, instead of target_epsilon (0: no privacy)"))
    per_sample_max_grad_norm: float = field(default=1.0, metadata=_help("per-sample clipping bound R"))
    clipping: str = field(default="abadi", metadata=_help(f"clipping function: {' | '.join(CLIPPING)}"))
    mode: str = field(default="auto", metadata=_help(f"per-sample gradient algorithm: {' | '.join(MODES)}"))
    accountant: str = field(default="rdp", metadata=_help("privacy accountant: rdp | pld | prv"))
    max_physical_batch_size: int | None = field(
        default=None,
        metadata=_help("largest forward pass (default: per_device_train_batch_size); memory only, not privacy"),
    )
    token_reduction: str = field(
        default="mean", metadata=_help("a sequence's loss over its own tokens: mean | sum (never across samples)")
    )
    train_head: str | None = field(default="auto", metadata=_help("mode=bitfit or lora: head trained in full"))
    noise_seed: int | None = field(default=None, metadata=_help("tests only: reproducible, not secret, noise"))
    sample_seed: int | None = field(default=None, metadata=_help("tests only: reproducible Poisson sampling"))
    self_check: bool = field(default=True, metadata=_help("compare per-sample norms with brute force on step 1"))
    accept_large_delta: bool = field(
        default=False, metadata=_help("accept δ >= 1/N (a claim that allows releasing a sample; recorded)")
    )
    user_column: str | None = field(
        default=None, metadata=_help("user-level DP: the dataset column of each example's user (None: per example)")
    )
    max_examples_per_user: int | None = field(
        default=None, metadata=_help("user-level DP: k, the most examples of one user in a step (ULS) or the run")
    )
    user_sampling: str = field(
        default="users", metadata=_help("user-level DP: users (sample users, clip each user's sum) | examples")
    )

    def __post_init__(self):
        if (self.target_epsilon is None) == (self.noise_multiplier is None):
            raise PrivacyUsageError("DPArguments: give either target_epsilon or noise_multiplier (not both).")
        if self.target_delta is None:
            raise PrivacyUsageError(
                "DPArguments needs target_delta (the δ of the guarantee, also needed to report ε): pass one "
                "below 1/N for N training samples, e.g. 1e-5."
            )
        if self.clipping not in CLIPPING:
            raise PrivacyUsageError(
                f"DPArguments.clipping must be one of {', '.join(CLIPPING)}, got {self.clipping!r}."
            )
        if self.mode not in MODES:
            raise PrivacyUsageError(f"DPArguments.mode must be one of {', '.join(MODES)}, got {self.mode!r}.")
        if self.token_reduction not in TOKEN_REDUCTIONS:
            raise PrivacyUsageError(
                f"DPArguments.token_reduction must be 'mean' or 'sum', got {self.token_reduction!r}."
            )
        m = self.max_physical_batch_size
        if m is not None and (not isinstance(m, numbers.Integral) or isinstance(m, bool) or m < 1):
            raise PrivacyUsageError(
                f"DPArguments.max_physical_batch_size must be a positive integer or None, got {m!r}."
            )


def _refusals(trainer) -> list[str]:
    """What in ``trainer``'s settings would make the reported ε false (or the engine unable to
    clip), each with its fix."""
    args = trainer.args
    out = []
    if args.dataloader_drop_last:
        out.append("dataloader_drop_last=True (Poisson batches are never cut; set it False)")
    strategy = getattr(args, "train_sampling_strategy", "random")
    if getattr(args, "group_by_length", False) or strategy not in ("random", None):
        out.append(
            f"train_sampling_strategy={strategy!r} / group_by_length (batches are Poisson-sampled, not grouped or "
            "ordered: leave the default 'random')"
        )
    if args.n_gpu > 1:
        out.append(f"DataParallel over {args.n_gpu} GPUs (it splits and gathers outside the hooks: run one GPU)")
    if args.world_size > 1:
        out.append(
            f"a distributed run of {args.world_size} processes (DistributedDataParallel all-reduces non-private "
            "gradients: use dpzoo.PrivacyEngine directly under torch.distributed)"
        )
    if args.deepspeed or getattr(trainer, "is_deepspeed_enabled", False):
        out.append("DeepSpeed (it owns the backward and the optimizer step: run without it)")
    if args.fsdp or getattr(trainer, "is_fsdp_enabled", False):
        out.append("FSDP (sharded parameters are outside the per-sample hooks: run without it)")
    if args.fp16 or args.bf16:
        out.append(
            f"{'fp16' if args.fp16 else 'bf16'}=True (autocast mixes dtypes inside the layers dpzoo clips: convert "
            "the model to one dtype instead, e.g. model.to(torch.bfloat16))"
        )
    if args.auto_find_batch_size:
        out.append("auto_find_batch_size=True (it changes the batch size, hence the sample rate, mid-run)")
    if args.torch_compile:
        out.append("torch_compile=True (dpzoo's per-sample hooks need eager mode)")
    if args.neftune_noise_alpha is not None:
        out.append("neftune_noise_alpha (its noise scale depends on the batch's padded length, mixing samples)")
    if getattr(args, "use_liger_kernel", False):
        out.append("use_liger_kernel=True (fused kernels hide layers and logits from per-sample clipping)")
    if getattr(args, "past_index", -1) >= 0:
        out.append("past_index >= 0 (memories carried between batches mix samples of different steps)")
    if "lomo" in str(getattr(args.optim, "value", args.optim)).lower():
        out.append(f"optim={args.optim!r} (LOMO updates inside backward, before clipping and noise)")
    if trainer.compute_loss_func is not None:
        out.append(
            "compute_loss_func (a batch-level loss cannot be checked to be per-sample: subclass DPTrainer and "
            "override per_sample_loss instead)"
        )
    dataset = trainer.train_dataset
    if isinstance(dataset, torch.utils.data.IterableDataset) or (
        dataset is not None and not hasattr(dataset, "__len__")
    ):
        out.append("an iterable train_dataset (Poisson sampling needs a dataset with len() and indexing)")
    return out


def check_trainer_settings(trainer, base_class) -> None:
    """Raise :class:`~dpzoo.errors.PrivacyUsageError` listing every Trainer setting of ``trainer`` that
    DP training refuses; ``base_class`` is DPTrainer (to see which methods a subclass overrides)."""
    bad = _refusals(trainer)
    cls = type(trainer)

    def overrides(name: str) -> bool:
        return inspect.getattr_static(cls, name, None) is not inspect.getattr_static(base_class, name)

    if issubclass(cls, base_class) and overrides("compute_loss") and not overrides("per_sample_loss"):
        bad.append(
            f"{cls.__name__} overrides compute_loss, which DPTrainer cannot check to be per-sample: override "
            "per_sample_loss (one loss per sample) for training; compute_loss then serves evaluation only"
        )
    if bad:
        raise PrivacyUsageError(
            "DPTrainer refuses these settings (ε would be false, or per-sample clipping impossible): "
            + "; ".join(bad)
            + "."
        )


def check_batch_fits(logical: int, n: int) -> None:
    """The expected logical batch must not exceed the dataset (sample rate q ≤ 1)."""
    if logical > n:
        raise PrivacyUsageError(
            f"per_device_train_batch_size × gradient_accumulation_steps = {logical} exceeds the {n} training "
            f"samples (sample rate > 1): make the product at most {n}."
        )


def total_steps(args, steps_per_epoch: int) -> int:
    """The logical steps the Trainer will take: ``max_steps``, or ⌈num_train_epochs × steps per epoch⌉
    (the Trainer's own count), the number σ is calibrated for."""
    if args.max_steps is not None and args.max_steps > 0:
        return int(args.max_steps)
    return max(1, math.ceil(args.num_train_epochs * steps_per_epoch))
