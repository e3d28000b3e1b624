"""The training data of :class:`~dpzoo.integrations.transformers.DPTrainer`: the engine's Poisson
batches, each handed to the Trainer as ``gradient_accumulation_steps`` chunks, and the chunks cut
into physical micro-batches.

The engine's :class:`~dpzoo.privacy.data.DPDataLoader` samples *indices* (an index dataset, so an
empty Poisson batch needs nothing of the user's data) and the Trainer's collator builds the batch.
:class:`PoissonTrainLoader` splits each logical batch of S samples into k =
``gradient_accumulation_steps`` chunks of about S/k rows — the Trainer's k accumulation
micro-steps, after which it calls ``optimizer.step()`` once: exactly one step, and one noise draw,
per logical batch. An empty batch (S = 0) is k empty chunks, so the Trainer still takes its step
(a noise-only update), counts it, and steps its schedule: the Trainer's step count is the
accountant's. ``DPTrainer.training_step`` cuts a chunk into micro-batches of at most
``max_physical_batch_size`` rows (:func:`micro_batches`), so memory stays bounded whatever S is.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any, Iterator

import torch
from torch.utils.data import Dataset, IterableDataset

from ..errors import PrivacyUsageError
from ..privacy import DPDataLoader
from ..privacy.data import split_between_users

__all__ = ["IndexDataset", "FetchCollate", "PoissonTrainLoader", "batch_rows", "take_rows", "micro_batches"]
__all__ += ["user_column", "user_population"]


class IndexDataset(Dataset):
    """Item i is the integer i: what the engine's Poisson loader samples."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return int(i)


class FetchCollate:
    """Collate of sampled indices: the dataset's items for them, through the Trainer's collator
    (picklable, so it runs in DataLoader workers), without the ``drop`` entry (the user column)."""

    def __init__(self, dataset, collate, drop: str | None = None):
        self.dataset, self.collate, self.drop = dataset, collate, drop

    def __call__(self, indices: list[int]):
        items = [self.dataset[int(i)] for i in indices]
        if self.drop is not None:
            items = [{k: v for k, v in item.items() if k != self.drop} for item in items]
        return self.collate(items)


def batch_rows(batch) -> int:
    """Rows (samples) of a collated batch: dimension 0 of its tensors (0 for an empty mapping)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, Mapping):
        for value in batch.values():
            if isinstance(value, torch.Tensor) and value.dim():
                return int(value.shape[0])
        return 0
    raise PrivacyUsageError(
        f"DPTrainer needs batches that are mappings of batch-first tensors (a Hugging Face collator's output), "
        f"got {type(batch).__name__}."
    )


def take_rows(batch: Mapping, start: int, stop: int, rows: int) -> dict:
    """Rows ``start:stop`` of every per-sample entry of ``batch`` (tensors with ``rows`` rows in
    dimension 0, lists of ``rows`` items); other entries are refused: they might carry several
    samples' data into each slice."""
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows:
            out[key] = value[start:stop]
        elif isinstance(value, (list, tuple)) and len(value) == rows:
            out[key] = value[start:stop]
        else:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise PrivacyUsageError(
                f"Batch entry {key!r} ({shape}) has no row per sample for the {rows} sampled samples: DPTrainer "
                "splits batches along dimension 0, so the collator must put the batch first in every entry."
            )
    return out


def micro_batches(chunk: Mapping, size: int, groups: torch.Tensor | None = None) -> Iterator[tuple]:
    """``chunk`` cut into consecutive (micro-batch, its rows' users) of at most ``size`` rows (none if
    it is empty); with ``groups`` (each row's user) only between users, users numbered from 0 in each."""
    rows = batch_rows(chunk)
    if groups is None:
        for start in range(0, rows, size):
            yield take_rows(chunk, start, min(start + size, rows), rows), None
        return
    for start, stop, local in split_between_users(torch.bincount(groups).tolist() if rows else [], size):
        if stop > start:
            yield take_rows(chunk, start, stop, rows), local


class PoissonTrainLoader(IterableDataset):
    """The Trainer's train loader: ``chunks`` consecutive items per Poisson batch of ``dp_loader``.

    ``len()`` is ``chunks`` × the logical steps per epoch (the Trainer divides it by its
    ``gradient_accumulation_steps`` = ``chunks`` to count optimizer steps). The object is its own
    ``dataset`` (an :class:`~torch.utils.data.IterableDataset`), so the Trainer's resume path,
    which skips the batches of the interrupted epoch with accelerate's ``skip_first_batches``,
    draws and drops fresh Poisson batches (nothing trained on them is released).
    """

    # read by accelerate's skip_first_batches, which wraps this object in a DataLoader: the items
    # are batches already, iterated in this process (the engine's loader has its own workers)
    batch_size = None
    drop_last = False
    num_workers = 0
    prefetch_factor = None

    @staticmethod
    def collate_fn(batch):
        return batch

    def __init__(self, dp_loader: DPDataLoader, chunks: int):
        self.dp_loader, self.chunks = dp_loader, int(chunks)
        self.dataset = self
        # user-level DP: each chunk's rows' users, in the order the chunks are yielded (the Trainer may
        # draw a chunk ahead of its training step; DPTrainer.training_step takes them first in, first out)
        self.chunk_groups: collections.deque = collections.deque()

    def __len__(self) -> int:
        return self.chunks * len(self.dp_loader)

    def __iter__(self) -> Iterator[Any]:
        signal = self.dp_loader.signal
        for batch in self.dp_loader:
            size = signal.logical_batch_size
            if size == 0:
                for _ in range(self.chunks):
                    self.chunk_groups.append(None)
                    yield {}
                continue
            rows = batch_rows(batch)
            if rows != size or not isinstance(batch, Mapping):
                raise PrivacyUsageError(
                    f"The collator returned {rows} rows for {size} sampled samples: DPTrainer needs a mapping "
                    "of batch-first tensors with one row per sample."
                )
            groups = signal.groups  # each row's user (user-level DP), users' rows next to each other
            bounds = [round(j * size / self.chunks) for j in range(self.chunks + 1)]
            if groups is not None:  # chunks end between users: a user's examples are clipped together
                ends = [0, *((groups[1:] != groups[:-1]).nonzero().flatten() + 1).tolist(), size]
                bounds = [min(ends, key=lambda e: abs(e - b)) for b in bounds]
            for j in range(self.chunks):
                part = None if groups is None else groups[bounds[j] : bounds[j + 1]]
                self.chunk_groups.append(None if part is None else part - part[0] if len(part) else part)
                yield take_rows(batch, bounds[j], bounds[j + 1], size)


def user_column(dataset, privacy, users_per_device: int) -> list | None:
    """The user of each training example, from ``DPArguments.user_column`` (None: example-level DP)."""
    column = privacy.user_column
    if column is None:
        if privacy.max_examples_per_user is not None:
            raise PrivacyUsageError(
                "DPArguments.max_examples_per_user needs user_column (the dataset column of users)."
            )
        return None
    k, size = privacy.max_examples_per_user, privacy.max_physical_batch_size or users_per_device
    if privacy.user_sampling == "users" and isinstance(k, int) and k > size:
        raise PrivacyUsageError(
            f"max_examples_per_user={k} exceeds the micro-batch of {size} rows: a user's examples are clipped "
            "together in one micro-batch. Raise DPArguments.max_physical_batch_size to at least k."
        )
    try:
        values = dataset[column]  # a datasets.Dataset column
    except (KeyError, TypeError, IndexError, ValueError):
        try:
            values = [dataset[i][column] for i in range(len(dataset))]
        except (KeyError, TypeError, IndexError) as e:
            raise PrivacyUsageError(
                f"DPArguments.user_column={column!r} is not a column of the training dataset ({type(e).__name__}: {e})."
            ) from None
    return list(values)


def user_population(users: list, k: int | None, sampling: str) -> int:
    """What q is a rate over: the users (``"users"``), or the examples kept, at most k per user."""
    counts = collections.Counter(users).values()
    if sampling == "users" or not isinstance(k, int) or k < 1:  # bad k: make_private refuses it, naming it
        return len(counts)
    return sum(min(c, k) for c in counts)
