"""Per-sample losses for DP training (one privacy unit = one row of the batch)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .errors import InvalidArgumentError

__all__ = ["SequenceCrossEntropy", "token_cross_entropy"]


def token_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, label_smoothing: float = 0.0
) -> torch.Tensor:
    """Per-token cross-entropy, (B, T, V) logits and (B, T) targets → (B, T), as
    :func:`torch.nn.functional.cross_entropy` with ``reduction="none"`` (ignored tokens 0), but
    with the softmax over the last, contiguous dimension: PyTorch's (B, V, T) layout runs a strided
    softmax that took ~90% of an H100's bf16 GPT-2 small step (benchmarks/results/gpu_h100_1126)."""
    logp = F.log_softmax(logits, dim=-1)
    kept = target != ignore_index
    nll = -logp.gather(-1, target.masked_fill(~kept, 0).unsqueeze(-1)).squeeze(-1)
    if label_smoothing:  # (1 − ε)·NLL + ε·(the mean NLL over the vocabulary), as PyTorch defines it
        nll = (1 - label_smoothing) * nll - label_smoothing * logp.mean(-1)
    return nll.masked_fill(~kept, 0.0)


class SequenceCrossEntropy(nn.Module):
    """Cross-entropy of a whole sequence as one sample's loss.

    ``logits``: (B, T, V) (or a model output with ``.logits``), ``target``: (B, T).
    With ``reduction="none"`` it returns Tensor[B], the per-sample losses that
    per-sample clipping needs (Opacus' ghost mode sets this itself); ``"sum"`` /
    ``"mean"`` reduce over samples. ``ignore_index`` tokens contribute nothing.
    ``token_reduction``: ``"sum"`` (default) or ``"mean"`` over a sequence's tokens.
    """

    def __init__(
        self, reduction: str = "mean", token_reduction: str = "sum", ignore_index: int = -100, shift: bool = False
    ):
        super().__init__()
        if reduction not in ("none", "sum", "mean") or token_reduction not in ("sum", "mean"):
            raise InvalidArgumentError(
                f"reduction must be none|sum|mean and token_reduction sum|mean, got {reduction!r} and {token_reduction!r}"
            )
        self.reduction, self.token_reduction = reduction, token_reduction
        self.ignore_index, self.shift = ignore_index, shift

    def forward(self, logits, target: torch.Tensor) -> torch.Tensor:
        logits = getattr(logits, "logits", logits)
        if self.shift:  # next-token prediction: logits[t] predicts target[t + 1]
            logits, target = logits[:, :-1], target[:, 1:]
        per_token = token_cross_entropy(logits, target, ignore_index=self.ignore_index)
        per_sample = per_token.sum(1)
        if self.token_reduction == "mean":
            per_sample = per_sample / (target != self.ignore_index).sum(1).clamp_min(1)
        if self.reduction == "none":
            return per_sample
        return per_sample.sum() if self.reduction == "sum" else per_sample.mean()
