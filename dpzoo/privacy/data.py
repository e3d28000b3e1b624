"""Poisson sampling (the sampling DP-SGD's accounting assumes) and physical micro-batches.

Each logical step includes every sample independently with probability q, so the batch
size varies and can be 0. A logical batch larger than ``max_physical_batch_size`` is split
into micro-batches; the optimizer accumulates their clipped sums and draws noise once per
logical step (it reads :class:`StepSignal`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.dataloader import default_collate

__all__ = ["PoissonBatchSampler", "DPDataLoader", "StepSignal"]


@dataclass
class StepSignal:
    """Shared by the loader and the optimizer: does the current micro-batch end a logical step?"""

    last_physical: bool = True
    logical_batch_size: int = 0


class PoissonBatchSampler(Sampler[list[int]]):
    """``steps`` batches, each including every index independently with probability ``sample_rate``."""

    def __init__(self, num_samples: int, sample_rate: float, steps: int | None = None,
                 generator: torch.Generator | None = None):
        if num_samples < 1 or not 0 < sample_rate <= 1:
            raise ValueError(f"need num_samples >= 1 and 0 < sample_rate <= 1, got {num_samples}, {sample_rate}")
        self.num_samples, self.sample_rate = num_samples, sample_rate
        self.steps = steps if steps is not None else max(1, round(1 / sample_rate))
        self.generator = generator

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            mask = torch.rand(self.num_samples, generator=self.generator) < self.sample_rate
            yield mask.nonzero().flatten().tolist()


def _empty_like(sample):
    """A batch of size 0 with the structure and shapes of one sample."""
    if isinstance(sample, torch.Tensor):
        return torch.zeros((0, *sample.shape), dtype=sample.dtype)
    if isinstance(sample, (int, float, bool)):
        return torch.zeros((0,), dtype=torch.as_tensor(sample).dtype)
    if isinstance(sample, dict):
        return {k: _empty_like(v) for k, v in sample.items()}
    if isinstance(sample, (list, tuple)):
        return type(sample)(_empty_like(v) for v in sample)
    raise TypeError(f"cannot build an empty batch of {type(sample).__name__}")


class DPDataLoader:
    """Poisson-sampled logical batches, optionally split into physical micro-batches.

    Iterating yields physical batches; ``signal.last_physical`` tells the optimizer when a
    logical step is complete. ``len()`` is the number of logical steps per epoch.
    """

    def __init__(self, dataset: Dataset, sample_rate: float, *, collate_fn=None, num_workers: int = 0,
                 max_physical_batch_size: int | None = None, steps: int | None = None,
                 generator: torch.Generator | None = None, signal: StepSignal | None = None, **loader_kwargs):
        self.dataset = dataset
        self.sample_rate = sample_rate
        self.batch_sampler = PoissonBatchSampler(len(dataset), sample_rate, steps, generator)
        self.collate_fn = collate_fn or default_collate
        self.max_physical_batch_size = max_physical_batch_size
        self.signal = signal or StepSignal()
        self._loader = DataLoader(dataset, batch_sampler=self.batch_sampler, collate_fn=self._collate,
                                  num_workers=num_workers, **loader_kwargs)

    @property
    def expected_batch_size(self) -> float:
        return self.sample_rate * len(self.dataset)

    def _collate(self, samples):
        if not samples:
            return _empty_like(self.dataset[0])
        return self.collate_fn(samples)

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self):
        for batch in self._loader:
            size = _batch_len(batch)
            chunk = self.max_physical_batch_size
            if not chunk or size <= chunk:
                self.signal.last_physical, self.signal.logical_batch_size = True, size
                yield batch
                continue
            starts = list(range(0, size, chunk))
            for i, s in enumerate(starts):
                self.signal.last_physical, self.signal.logical_batch_size = i == len(starts) - 1, size
                yield _slice(batch, s, s + chunk)


def _batch_len(batch) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, dict):
        return _batch_len(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)):
        return _batch_len(batch[0])
    raise TypeError(f"cannot tell the batch size of {type(batch).__name__}")


def _slice(batch, start, stop):
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, dict):
        return {k: _slice(v, start, stop) for k, v in batch.items()}
    return type(batch)(_slice(v, start, stop) for v in batch)
