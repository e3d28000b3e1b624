"""Per-sample losses from a Hugging Face model's logits and labels, for DP training with the Trainer.

Per-sample clipping needs the loss to be a sum (or mean) of per-sample losses, each depending on
its own sample only. The Trainer's default loss does not guarantee it: a causal or masked LM's loss
is a mean over *all* the batch's tokens, so a sample's weight depends on the other samples' lengths
(docs/GUIDE.md, "The loss after the model"). Here each sample's loss is reduced over its own tokens only
(``token_reduction``: mean or sum), then the batch's losses are returned unreduced, Tensor[B].

The task follows the model's head, as the Trainer's own loss does: causal LMs (the classes of
``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``) shift labels by one; (B, T, V) logits with (B, T) labels
otherwise (token classification, masked LM, seq2seq) are per-token cross-entropies without
shift; (B, C) logits are sequence classification, with ``config.problem_type``'s rule
(regression, single- or multi-label), like ``*ForSequenceClassification``. Label smoothing is the
Trainer's (``label_smoothing_factor``: (1 − ε)·NLL + ε·mean over classes of −log p).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ..errors import PrivacyUsageError
from ..losses import token_cross_entropy

__all__ = ["loss_kind", "per_sample_losses", "IGNORE_INDEX"]

IGNORE_INDEX = -100  # transformers' label for positions without a loss (padding, prompts)


def loss_kind(model) -> str:
    """``"causal-lm"`` for a causal LM (also inside a PEFT wrapper), else ``"by-shape"``."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    return "causal-lm" if type(base).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()) else "by-shape"


def at_least_float32(t: torch.Tensor) -> torch.Tensor:
    """Half-precision logits in float32 for the loss; float64 stays float64."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _token_losses(logits, labels, *, shift: bool, token_reduction: str, label_smoothing: float) -> torch.Tensor:
    if shift:  # logits[t] predicts labels[t + 1]
        logits, labels = logits[:, :-1], labels[:, 1:]
    per_token = token_cross_entropy(
        at_least_float32(logits), labels, ignore_index=IGNORE_INDEX, label_smoothing=label_smoothing
    )
    per_sample = per_token.sum(1)
    if token_reduction == "mean":  # over this sample's own labelled tokens (0 if it has none)
        per_sample = per_sample / (labels != IGNORE_INDEX).sum(1).clamp_min(1)
    return per_sample


def _classification_losses(logits, labels, *, problem_type, num_labels, label_smoothing) -> torch.Tensor:
    logits = at_least_float32(logits)
    if problem_type is None:  # the rule of transformers' *ForSequenceClassification
        if num_labels == 1:
            problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem_type = "single_label_classification"
        else:
            problem_type = "multi_label_classification"
    b = logits.shape[0]
    if problem_type == "regression":
        return (logits.reshape(b, -1) - labels.to(logits.dtype).reshape(b, -1)).pow(2).mean(1)
    if problem_type == "single_label_classification":
        return F.cross_entropy(logits, labels.reshape(b), reduction="none", label_smoothing=label_smoothing)
    if problem_type == "multi_label_classification":
        bce = F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none")
        return bce.reshape(b, -1).mean(1)
    raise PrivacyUsageError(
        f"problem_type={problem_type!r} has no per-sample loss here: subclass DPTrainer and override per_sample_loss."
    )


def per_sample_losses(
    outputs,
    labels: torch.Tensor,
    *,
    kind: str,
    token_reduction: str = "mean",
    label_smoothing: float = 0.0,
    problem_type: str | None = None,
    num_labels: int | None = None,
) -> torch.Tensor:
    """Tensor[B]: each sample's loss, from ``outputs.logits`` and ``labels`` (see the module docstring)."""
    logits = outputs.get("logits") if isinstance(outputs, dict) else getattr(outputs, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise PrivacyUsageError(
            "The model returned no logits to compute per-sample losses from: subclass DPTrainer and override "
            "per_sample_loss(model, inputs) to return one loss per sample."
        )
    b = logits.shape[0]
    if labels.shape[0] != b:
        raise PrivacyUsageError(
            f"labels have {labels.shape[0]} rows for {b} rows of logits: labels must be batch-first."
        )
    if logits.dim() == 3 and labels.dim() == 2 and labels.shape[1] == logits.shape[1]:
        return _token_losses(
            logits, labels, shift=kind == "causal-lm", token_reduction=token_reduction, label_smoothing=label_smoothing
        )
    if logits.dim() == 2 and kind != "causal-lm":
        return _classification_losses(
            logits, labels, problem_type=problem_type, num_labels=num_labels, label_smoothing=label_smoothing
        )
    raise PrivacyUsageError(
        f"Cannot tell the per-sample loss of logits {tuple(logits.shape)} with labels {tuple(labels.shape)}: "
        "subclass DPTrainer and override per_sample_loss(model, inputs) to return one loss per sample."
    )
