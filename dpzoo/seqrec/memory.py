"""The physical batch size of next-item training chosen from memory (``max_physical_batch_size="auto"``).

One job: :func:`choose_physical_batch` returns the largest micro-batch whose estimated peak memory
in training (forward, backward, per-sample norms and clipped sums by dpzoo's hooks, and on the
first step the engine's self-check) fits in :data:`BUDGET_FRACTION` of the memory available on
the training device, or whole batches when the expected logical batch fits. Physical batching changes memory and time only: the engine adds
the micro-batches' clipped sums and draws the noise once per logical (Poisson) batch, so the DP
step and ε are those of the unsplit batch (:mod:`dpzoo.privacy.data`).

Available memory: :func:`dpzoo.device_memory.available_memory` (CUDA: the driver's free memory;
elsewhere MemAvailable under any cgroup limit), its source said in the run's first line.

The estimate (:func:`sample_bytes`) counts, per sample, the dominant tensors of dpzoo's next-item
models, in elements of the model's dtype (T the input length, V the items, d the width):

* the full softmax, 4 · T · (V + 1): the logits, the log-softmax kept for backward, its gradient,
  and the logits' gradient, which the hooks hold until the clipped sum;
* each Transformer block, T · d · (15 + 4.5 · ffn_mult) + 3.5 · heads · T²: activations kept for
  backward, dropout masks and gradients, the attention matrices;
* a GRU / LSTM, T · gates · d · (d + 8): the hidden projection runs once per step and the hooks
  hold a per-sample gradient of it for every step (a parameter used more than twice is summed
  densely), beside the gates' activations;
* embeddings and the last LayerNorm, 8 · T · d; with ``mode="instantiate"``, 1.5 × the trainable
  parameters (per-sample gradients of every parameter);
* on the first step only, the engine's self-check (:mod:`dpzoo.privacy.verify`) runs the
  micro-batch again beside the step's own tensors: 3.5 · T · (V + 1) more
  (:func:`self_check_bytes`). The micro-batch is sized for that step, the highest of the run;
  the later steps peak at about 55 to 70% of it.

The coefficients are fitted to peaks measured on the CPU: the peak resident memory of a step with
glibc's mmap threshold at 64 kB (so freed tensors go back to the system), its slope between
micro-batches of 16 and 48, for 13 configurations (Transformers at T 50 and 200, V 200 to 24,000,
d 64 and 256, 1 to 4 heads and blocks, Re-Attention, untied, GRU, LSTM; modes auto, bk and
instantiate; dropout 0.2). The estimate is 1.01 to 1.18 times the measured slope on all of them;
at V 24,000 and T 50 (Amazon Video Games) 18.8 MB per sample measured, 19.0 MB estimated: the
logits count 4.1 times. Whole runs of ``train_seqrec`` (V 24,000 at T 50, V 3,416 and 1,000 at
T 200, DPFormer, GRU) agree: 5.9 to 18.9 MB per sample on later steps, and 1.1 to 3.3 more logit
copies on the first (the self-check's peak overlaps the step's own where the blocks weigh more). tests/test_auto_physical_batch.py measures a run again. Memory that does not
grow with the micro-batch (weights are allocated before the available memory is read): the
gradient, Adam's two moments, the engine's accumulated clipped sum and its noise, 5 × the
trainable parameters.

An estimate rather than a measurement: the CPU has no allocator counter to read a peak from (a
process's high-water mark depends on the allocator's history), and one path on every device is one
path tested. Measuring a CUDA step (``torch.cuda.max_memory_allocated`` of a hooked two-sample step
on a copy of the model) would be exact there; it is not done, as no GPU was at hand to test it. The
half-memory budget leaves room for what the estimate does not count (the CUDA allocator's rounding,
evaluation batches, other processes).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
from torch import nn

from ..device_memory import ASSUMED_AVAILABLE, available_memory
from ..errors import InvalidArgumentError
from ..privacy.modes import MODES
from .configuration import SeqRecConfig
from .modeling import SeqRecRNN

__all__ = [
    "PhysicalBatch",
    "choose_physical_batch",
    "check_physical_batch_size",
    "available_memory",
    "sample_bytes",
    "self_check_bytes",
    "fixed_bytes",
    "BUDGET_FRACTION",
    "ASSUMED_AVAILABLE",
]

# the share of the available memory one micro-batch's step may take (the rest: headroom, evaluation)
BUDGET_FRACTION = 0.5
# per-sample elements (see the module docstring)
LOGIT_COPIES = 4.0
SELF_CHECK_LOGIT_COPIES = 3.5
BLOCK_PER_TD, BLOCK_PER_FFN_TD, BLOCK_PER_HEAD_TT = 15.0, 4.5, 3.5
EDGES_PER_TD = 8.0
INSTANTIATE_PER_PARAM = 1.5
FIXED_PER_PARAM = 5.0


@dataclass(frozen=True)
class PhysicalBatch:
    """The physical batching of a run: ``size`` (the micro-batch bound handed to ``make_private``;
    None: whole logical batches), whether it was chosen by ``auto``, and what it was chosen from."""

    size: int | None
    auto: bool = False
    batch_size: int | None = None  # the expected logical batch
    sample_bytes: float | None = None
    check_bytes: float | None = None  # per sample, on the first step only
    fixed_bytes: float | None = None
    available_bytes: float | None = None
    memory_source: str | None = None

    def peak_bytes(self) -> float | None:
        """The estimated peak of the run: the first step's, with a micro-batch of ``size`` (a whole
        expected batch if unsplit)."""
        if self.sample_bytes is None or self.fixed_bytes is None:
            return None
        samples = self.size if self.size is not None else (self.batch_size or 0)
        return self.fixed_bytes + samples * (self.sample_bytes + (self.check_bytes or 0.0))

    def describe(self) -> str:
        """For the run's first line: "physical batches of at most 412 (auto: 9.8 GB of 21.0 GB available)"."""
        head = f"physical batches of at most {self.size}" if self.size is not None else "whole batches"
        if not self.auto:
            return head
        if self.size is None:
            head += f" of about {self.batch_size}"
        peak, available = _size(self.peak_bytes() or 0.0), _size(self.available_bytes or 0.0)
        assumed = ", assumed" if self.memory_source == "assumed" else ""
        return f"{head} (auto: {peak} of {available} available{assumed})"

    def as_dict(self) -> dict:
        """What metrics.json records."""
        return {
            "max_physical_batch_size": self.size,
            "auto": self.auto,
            "estimated_peak_bytes": self.peak_bytes(),
            "estimated_bytes_per_sample": self.sample_bytes,
            "first_step_extra_bytes_per_sample": self.check_bytes,
            "available_bytes": self.available_bytes,
            "memory_source": self.memory_source,
            "budget_fraction": BUDGET_FRACTION if self.auto else None,
        }


def _size(num_bytes: float) -> str:
    """Bytes as "9.8 GB" (or MB, kB: sizes of tiny test runs stay readable)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes / 1e3:.1f} kB"


def check_physical_batch_size(value) -> None:
    """Refuse a ``max_physical_batch_size`` that is not "auto", None or a whole number >= 1."""
    if value is None or (isinstance(value, str) and value == "auto"):
        return
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1:
        return
    raise InvalidArgumentError(
        f"max_physical_batch_size must be 'auto' (the largest micro-batch that fits in half of the available "
        f"memory), None (whole batches) or a whole number >= 1, got {value!r}."
    )


def _trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters() if p.requires_grad}.values())


def _element_size(model: nn.Module) -> int:
    return next(model.parameters()).element_size()


def _config_and_outputs(model: nn.Module) -> tuple[SeqRecConfig, int]:
    """The model's configuration and its softmax width (items + 1), or a refusal."""
    cfg = getattr(model, "config", None)
    out = getattr(model, "out", None)
    if not isinstance(cfg, SeqRecConfig) or not isinstance(out, nn.Linear):
        raise InvalidArgumentError(
            f"max_physical_batch_size='auto' estimates the memory of dpzoo's next-item models, not of "
            f"{type(model).__name__}: give a number of samples instead."
        )
    return cfg, out.out_features


def sample_bytes(model: nn.Module, max_len: int, mode: str = "bk-mixopt") -> float:
    """The estimated peak bytes one sample of length ``max_len`` adds to a training step of
    ``model`` (a :class:`~dpzoo.seqrec.SeqRecTransformer` or :class:`~dpzoo.seqrec.SeqRecRNN`) in
    the engine's ``mode``; the terms and their measurements are in the module docstring."""
    cfg, outputs = _config_and_outputs(model)
    t, d = max_len, cfg.d_model
    elements = LOGIT_COPIES * t * outputs + EDGES_PER_TD * t * d
    if isinstance(model, SeqRecRNN):
        elements += t * model.rnn.gates * d * (d + 8)
    else:
        block = t * d * (BLOCK_PER_TD + BLOCK_PER_FFN_TD * cfg.ffn_mult) + BLOCK_PER_HEAD_TT * cfg.num_heads * t * t
        elements += cfg.num_blocks * block
    if MODES.get(mode) == "instantiate":
        elements += INSTANTIATE_PER_PARAM * _trainable(model)
    return elements * _element_size(model)


def self_check_bytes(model: nn.Module, max_len: int) -> float:
    """The bytes per sample the engine's first-step self-check adds to :func:`sample_bytes`: the
    micro-batch run again in eval mode, its logits, their cotangents and a detached copy."""
    return SELF_CHECK_LOGIT_COPIES * max_len * _config_and_outputs(model)[1] * _element_size(model)


def fixed_bytes(model: nn.Module) -> float:
    """Bytes a step adds whatever the micro-batch: the gradient, Adam's moments, the engine's
    accumulated clipped sum and noise (the weights are in memory already)."""
    return FIXED_PER_PARAM * _trainable(model) * _element_size(model)


def choose_physical_batch(
    value: int | str | None,
    model: nn.Module,
    *,
    max_len: int,
    batch_size: int,
    device: torch.device | str,
    mode: str = "bk-mixopt",
) -> PhysicalBatch:
    """The physical batching for ``value``: None (whole batches) and a number are taken as they
    are; "auto" takes the largest micro-batch K whose first step (fixed + K · (per-sample +
    self-check bytes)) fits in :data:`BUDGET_FRACTION` of :func:`available_memory`, at least 1, and
    whole batches (None) when K reaches the expected logical ``batch_size`` (so never more than the
    logical batch)."""
    check_physical_batch_size(value)
    if value != "auto":
        return PhysicalBatch(size=None if value is None else int(value), batch_size=batch_size)
    per_sample, fixed = sample_bytes(model, max_len, mode), fixed_bytes(model)
    check = self_check_bytes(model, max_len)
    available, source = available_memory(device)
    fits = int((BUDGET_FRACTION * available - fixed) // (per_sample + check))
    size = None if fits >= batch_size else max(1, fits)
    return PhysicalBatch(
        size=size,
        auto=True,
        batch_size=batch_size,
        sample_bytes=per_sample,
        check_bytes=check,
        fixed_bytes=fixed,
        available_bytes=available,
        memory_source=source,
    )
