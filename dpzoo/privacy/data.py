"""Poisson sampling (the sampling DP-SGD's accounting assumes) and physical micro-batches.

Each logical step includes every sample independently with probability q, so the batch
size varies and can be 0. A logical batch larger than ``max_physical_batch_size`` is split
into micro-batches; the optimizer accumulates their clipped sums and draws noise once per
logical step (it reads :class:`StepSignal`, which also tells it how many samples the logical
batch holds, so it can refuse a step that clipped a different number of rows).

Membership is secret: unless a ``generator`` is passed (reproducible sampling, for tests),
every epoch draws from a generator seeded with 64 bits from the operating system's CSPRNG
(``os.urandom``), never from torch's global seed. Under ``torch.distributed`` each rank samples
only its shard (``indices``) of the one dataset, so every sample has probability q of being in
the global batch, once.
"""

from __future__ import annotations

import collections
import hashlib
import os
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.dataloader import default_collate

from ..errors import InvalidArgumentError, PrivacyUsageError, UnsupportedBatchError
from ..grad_norms.sample_rows import track_batch

__all__ = ["PoissonBatchSampler", "DPDataLoader", "StepSignal", "secret_generator", "dataset_fingerprint"]
__all__ += ["split_between_users"]


def secret_generator(device: "torch.device | str" = "cpu") -> torch.Generator:
    """A torch generator seeded with 64 bits of OS entropy (not reproducible, not torch's seed)."""
    g = torch.Generator(device=device)
    g.manual_seed(int.from_bytes(os.urandom(8), "little"))
    return g


@dataclass
class StepSignal:
    """Shared by the loader and the optimizer: which logical batch the current micro-batch belongs
    to, how many samples that logical batch holds, and whether the micro-batch ends it."""

    last_physical: bool = True
    logical_batch_size: int = 0
    logical_index: int = -1  # counts the logical batches the loader produced (-1: none yet)
    groups: torch.Tensor | None = None  # user-level DP: each row's user in the current micro-batch
    # set by the engine: called for an empty logical batch instead of yielding it (noise-only step)
    on_empty: Callable[[], None] | None = None


class PoissonBatchSampler(Sampler[list[int]]):
    """``steps`` batches, each including every index independently with probability ``sample_rate``.

    ``indices``: sample only these dataset indices (a rank's shard); default ``range(num_samples)``.
    ``generator``: reproducible membership (not secret); default: fresh OS entropy each epoch.
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        steps: int | None = None,
        generator: torch.Generator | None = None,
        indices: Sequence[int] | None = None,
    ):
        if num_samples < 1 or not 0 < sample_rate <= 1:
            raise InvalidArgumentError(
                f"need num_samples >= 1 and 0 < sample_rate <= 1, got {num_samples}, {sample_rate}"
            )
        self.num_samples, self.sample_rate = num_samples, sample_rate
        self.steps = steps if steps is not None else max(1, round(1 / sample_rate))
        self.generator = generator
        self.indices = torch.as_tensor(list(indices), dtype=torch.long) if indices is not None else None

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        gen = self.generator if self.generator is not None else secret_generator()
        n = len(self.indices) if self.indices is not None else self.num_samples
        for _ in range(self.steps):
            picked = (torch.rand(n, generator=gen) < self.sample_rate).nonzero().flatten()
            if self.indices is not None:
                picked = self.indices[picked]
            yield picked.tolist()


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
    raise UnsupportedBatchError(
        f"cannot build an empty batch of {type(sample).__name__}: dataset items must be tensors, numbers, "
        "or dicts/lists/tuples of them (or pass a collate_fn that handles an empty list)"
    )


class DPDataLoader:
    """Poisson-sampled logical batches, optionally split into physical micro-batches.

    Iterating yields physical batches; ``signal.last_physical`` tells the optimizer when a
    logical step is complete. ``len()`` is the number of logical steps per epoch.
    """

    def __init__(
        self,
        dataset: Dataset,
        sample_rate: float,
        *,
        collate_fn=None,
        num_workers: int = 0,
        max_physical_batch_size: int | None = None,
        steps: int | None = None,
        generator: torch.Generator | None = None,
        signal: StepSignal | None = None,
        indices: Sequence[int] | None = None,
        batch_sampler: Sampler | None = None,
        **loader_kwargs,
    ):
        self.dataset = dataset
        self.sample_rate = sample_rate
        # batch_sampler: another Poisson sampler (users: dpzoo.privacy.users), else over examples
        self.batch_sampler = batch_sampler or PoissonBatchSampler(len(dataset), sample_rate, steps, generator, indices)
        self.collate_fn = collate_fn or default_collate
        self.max_physical_batch_size = max_physical_batch_size
        self.signal = signal or StepSignal()
        self._sizes: collections.deque = collections.deque()  # indices drawn per batch, in order
        self.first_batch: tuple | None = None  # (the first physical batch yielded, its rows' dataset indices)
        self._loader = DataLoader(
            dataset,
            batch_sampler=_Counting(self.batch_sampler, self._sizes),
            collate_fn=self._collate,
            num_workers=num_workers,
            **loader_kwargs,
        )

    # What a torch DataLoader exposes and Opacus' BatchMemoryManager reads, so that it gets as far
    # as the optimizer's signal_skip_step, which refuses it with a clear message.
    num_workers = property(lambda self: self._loader.num_workers)
    pin_memory = property(lambda self: self._loader.pin_memory)
    timeout = property(lambda self: self._loader.timeout)
    worker_init_fn = property(lambda self: self._loader.worker_init_fn)
    multiprocessing_context = property(lambda self: self._loader.multiprocessing_context)
    generator = property(lambda self: self._loader.generator)
    prefetch_factor = property(lambda self: self._loader.prefetch_factor)
    persistent_workers = property(lambda self: self._loader.persistent_workers)

    @property
    def expected_batch_size(self) -> float:
        """Expected size of this loader's logical batches (of this rank's shard, if sharded), in
        privacy units: examples, or users when the loader samples users."""
        users = getattr(self.batch_sampler, "users", None)
        if users is not None:
            return self.sample_rate * len(users)
        n = len(self.batch_sampler.indices) if self.batch_sampler.indices is not None else len(self.dataset)
        return self.sample_rate * n

    def _collate(self, samples):
        if not samples:
            return _empty_like(self.dataset[0])
        out = self.collate_fn(samples)
        if hasattr(self.batch_sampler, "last_counts") and self.collate_fn not in KEEP_ORDER and len(samples) > 1:
            check_keeps_order(self.collate_fn, samples, out)  # a user's rows must stay next to each other
        return out

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self):
        sig = self.signal
        self._sizes.clear()
        for batch in self._loader:
            # the sampler's count, not dim 0 of whatever the collate built (a (T, B) padded layout)
            size, users, drawn = self._sizes.popleft()
            sig.logical_index += 1
            sig.logical_batch_size = size
            if size == 0 and sig.on_empty is not None:
                # An empty Poisson batch is still a step of the mechanism (a noise-only update):
                # the engine takes it here, so training loops never see a batch of 0 rows.
                sig.last_physical = True
                sig.on_empty()
                continue
            chunk = self.max_physical_batch_size
            if users is not None:  # user-level: micro-batches split between users only
                yield from self._by_users(batch, size, users)
                continue
            sig.groups = None
            if not chunk or size <= chunk:
                sig.last_physical = True
                yield self._first(track_batch(batch, size), drawn)  # row i is sample i: mixing is seen (sample_rows)
                continue
            self._check_len(batch, size)
            starts = list(range(0, size, chunk))
            for i, s in enumerate(starts):
                sig.last_physical = i == len(starts) - 1
                yield self._first(track_batch(_slice(batch, s, s + chunk), min(chunk, size - s)), drawn[s : s + chunk])

    def _first(self, batch, drawn: list):
        """The first batch yielded, with the dataset indices of its rows (the self-check's padding check)."""
        if self.first_batch is None:
            self.first_batch = (batch, list(drawn))
        return batch

    def _by_users(self, batch, size: int, counts: list[int]):
        sig = self.signal
        pieces = split_between_users(counts, self.max_physical_batch_size)
        if len(pieces) > 1:
            self._check_len(batch, size)
        for i, (start, stop, groups) in enumerate(pieces):
            sig.last_physical, sig.groups = i == len(pieces) - 1, groups
            yield track_batch(batch if len(pieces) == 1 else _slice(batch, start, stop), stop - start)

    @staticmethod
    def _check_len(batch, size: int) -> None:
        if _batch_len(batch) != size:
            raise PrivacyUsageError(
                f"The collated batch has {_batch_len(batch)} rows in dimension 0 for {size} sampled samples: "
                "max_physical_batch_size splits dimension 0, so the collate must put the batch there "
                "(e.g. pad_sequence(..., batch_first=True))."
            )


def split_between_users(counts: list[int], chunk: int | None) -> list[tuple[int, int, torch.Tensor]]:
    """A logical batch whose users have ``counts`` examples (in order) as micro-batches of at
    most ``chunk`` rows, split only between users: [(start, stop, each row's user 0 … u−1)]."""
    if chunk and counts and max(counts) > chunk:
        raise PrivacyUsageError(
            f"Micro-batches of at most {chunk} rows are below max_examples_per_user: a user's examples must be "
            "clipped together in one micro-batch. Use max_physical_batch_size >= max_examples_per_user."
        )
    pieces: list[tuple[int, int, torch.Tensor]] = []
    start, current = 0, list[int]()
    for c in counts:
        if current and chunk and sum(current) + c > chunk:
            pieces.append(_piece(start, current))
            start, current = start + sum(current), []
        current.append(c)
    pieces.append(_piece(start, current))
    return pieces


def _piece(start: int, counts: list[int]) -> tuple[int, int, torch.Tensor]:
    groups = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts, dtype=torch.long))
    return start, start + sum(counts), groups


class _Counting(Sampler[list[int]]):
    """Passes a batch sampler through, noting how many indices each batch has (the DataLoader
    iterates its batch sampler in the main process, in order, also with workers)."""

    def __init__(self, inner: PoissonBatchSampler, sizes: collections.deque):
        self.inner, self.sizes = inner, sizes

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self):
        for idx in self.inner:  # and each user's examples in it, when the sampler samples users
            self.sizes.append((len(idx), getattr(self.inner, "last_counts", None), idx))
            yield idx


KEEP_ORDER = (default_collate,)  # collates known to keep row i = sample i


def check_keeps_order(collate, samples: list, out) -> None:
    """Refuse a collate that does not keep the samples' order (sorting by length for packing, by
    label...): with user-level sampling the rows' users are positional, so a reordered batch would
    clip rows of several users as one. Checked by collating the samples rotated by one: every per-row
    entry must come back rotated (a sorting collate gives one order whatever the input's, a
    reversing one the other rotation)."""
    with torch.random.fork_rng(devices=[]):
        state = torch.get_rng_state()
        rev = collate(samples[1:] + samples[:1])
        torch.set_rng_state(state)

    def same(a, b) -> bool:
        if isinstance(a, torch.Tensor):
            if not isinstance(b, torch.Tensor) or a.shape != b.shape:
                return False
            return bool(torch.equal(a.roll(-1, 0), b)) if a.dim() and a.shape[0] == len(samples) else torch.equal(a, b)
        if isinstance(a, dict) or hasattr(a, "keys"):
            return set(a.keys()) == set(b.keys()) and all(same(a[k], b[k]) for k in a.keys())
        if isinstance(a, (list, tuple)):
            if len(a) == len(samples) and not any(isinstance(v, torch.Tensor) for v in a):
                return list(a)[1:] + list(a)[:1] == list(b)
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b

    if not same(out, rev):
        raise PrivacyUsageError(
            "With privacy_unit='user' the collate_fn must keep the samples' order (row i = sample i): this one "
            "reorders them (or is random per batch), so rows of several users would be clipped as one. Sort or "
            "augment in the dataset, not in the collate."
        )


def _batch_len(batch) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, dict):
        return _batch_len(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)):
        return _batch_len(batch[0])
    raise UnsupportedBatchError(
        f"cannot tell the batch size of {type(batch).__name__}: the collate_fn must return a tensor, "
        "or a dict/list/tuple whose first entry is one, with one row per sample in dimension 0"
    )


def _slice(batch, start, stop):
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, dict):
        return {k: _slice(v, start, stop) for k, v in batch.items()}
    return type(batch)(_slice(v, start, stop) for v in batch)


def _to_bytes(obj, out: list) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(str((obj.dtype, tuple(obj.shape))).encode())
        out.append(obj.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes() if obj.numel() else b"")
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            out.append(str(k).encode())
            _to_bytes(obj[k], out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _to_bytes(v, out)
    elif hasattr(obj, "tobytes"):  # numpy arrays and scalars
        out.append(obj.tobytes())
    else:
        out.append(repr(obj).encode())


def dataset_fingerprint(dataset) -> str:
    """Length and a hash of a few items: equal on every rank iff (very likely) the same dataset."""
    n = len(dataset)
    parts: list = [str(n).encode()]
    for i in sorted({0, n // 3, n // 2, n - 1} if n else set()):
        _to_bytes(dataset[i], parts)
    return hashlib.sha256(b"\0".join(parts)).hexdigest()
