"""Your own texts as a private training set: a CSV or Parquet file with a text column and a label,
tokenized by the pretrained model's own tokenizer, for its sequence classifier.

Each text is tokenized on its own, truncated and padded to ``max_length`` tokens: no example's
length decides another's padding, so a batch's forward pass treats each sample alone (dynamic
padding to the batch's longest text would not; docs/DESIGN.md). The tokenizer is the pretrained
model's, public; nothing is fitted on the private texts. A batch is packed as one tensor
(ids and attention mask, :class:`PackedTextClassifier`), so the training loop, the engine's
Poisson sampling and the evaluation treat it as they treat images.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ..errors import InvalidArgumentError
from .table import read_text_table, split_rows

__all__ = ["PackedTextClassifier", "load_tokenizer", "tokenize", "text_splits", "text_eval_set"]


class PackedTextClassifier(nn.Module):
    """A Hugging Face sequence classifier on packed inputs: ``x`` (B, 2, T) holds each example's
    token ids and attention mask; returns the logits. ``model`` is the classifier itself (what is
    saved and loaded)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x[:, 0], attention_mask=x[:, 1]).logits


def load_tokenizer(source: str | Path):
    """The tokenizer of a Hugging Face directory or hub id (a download when it is not cached)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(source))
    except (OSError, ValueError) as e:
        raise InvalidArgumentError(
            f"no tokenizer at {source} ({str(e).splitlines()[0][:160]}): give --weights a Hugging Face directory "
            "with its tokenizer files, or --pretrained with the hub reachable."
        ) from None


def tokenize(tokenizer, texts: Sequence[str], max_length: int) -> torch.Tensor:
    """(N, 2, max_length) int64: each text's ids and attention mask, truncated and padded alone."""
    enc = tokenizer(list(texts), truncation=True, max_length=max_length, padding="max_length", return_tensors="pt")
    return torch.stack([enc["input_ids"], enc["attention_mask"]], 1)


def text_splits(
    path: str | Path,
    text_column: str,
    label_column: str,
    tokenizer,
    max_length: int,
    test_fraction: float = 0.2,
    seed: int = 0,
) -> tuple[TensorDataset, TensorDataset, list[str]]:
    """(train, test, class names): the file's rows, tokenized, split at random (``seed``)."""
    texts, y, classes = read_text_table(path, text_column, label_column)
    train, test = split_rows(path, len(y), classes, label_column, test_fraction, seed)
    x = tokenize(tokenizer, texts, max_length)
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test]), classes


def text_eval_set(
    path: str | Path, text_column: str, label_column: str, classes: Sequence[str], tokenizer, max_length: int
) -> TensorDataset:
    """Every row of ``path``, tokenized, labelled with a trained run's classes."""
    texts, y, _ = read_text_table(path, text_column, label_column, classes)
    return TensorDataset(tokenize(tokenizer, texts, max_length), y)
