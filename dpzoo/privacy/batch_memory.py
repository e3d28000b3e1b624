"""``BatchMemoryManager``: Opacus' context manager for bounding the physical batch size, on
dpzoo's Poisson loader and optimizer.

    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=32, optimizer=optimizer) as mem_loader:
        for x, y in mem_loader:                    # physical batches of at most 32 rows
            criterion(model(x), y).backward()
            optimizer.step()                       # a real step only after a logical batch's last
            optimizer.zero_grad()                  #   physical batch: one noise draw, one accounted step

Each Poisson-sampled logical batch is split into physical batches; the optimizer accumulates
their clipped sums and adds noise once, at the last one (BK paper Algorithm 1, lines 6–12, over
micro-batches), so the update and the privacy accounting are those of the unsplit logical batch.
It is the same mechanism as ``make_private(max_physical_batch_size=...)``: the loader marks
the last physical batch in the :class:`~dpzoo.privacy.data.StepSignal` it shares with the
optimizer, and ``optimizer.step()`` only accumulates before it (``DPOptimizer.pre_step``).

Opacus' own ``opacus.utils.batch_memory_manager.BatchMemoryManager`` does not work on dpzoo's
loader and optimizer (it rebuilds a torch ``DataLoader`` around the loader's sampler, bypassing
the step signal, and calls Opacus-only optimizer methods): it fails, and no step is accounted.
Import this one instead; it refuses Opacus' optimizer or loader the same way.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Iterator

from ..errors import PrivacyUsageError
from .data import DPDataLoader
from .optimizer import DPOptimizer

__all__ = ["BatchMemoryManager", "PhysicalBatchLoader"]


class PhysicalBatchLoader:
    """The loader a :class:`BatchMemoryManager` hands out: iterating it iterates ``data_loader``
    (the same Poisson batches, step signal and noise-only steps) with every logical batch split
    into physical batches of at most ``max_physical_batch_size`` rows (or the loader's own bound,
    if smaller). ``data_loader`` itself is left as it was."""

    def __init__(self, data_loader: DPDataLoader, max_physical_batch_size: int):
        self.data_loader = data_loader
        own = data_loader.max_physical_batch_size
        self.max_physical_batch_size = min(own, max_physical_batch_size) if own else max_physical_batch_size

    @property
    def dataset(self):
        return self.data_loader.dataset

    @property
    def sample_rate(self) -> float:
        return self.data_loader.sample_rate

    def __len__(self) -> int:
        """The expected number of physical batches per epoch, Opacus' estimate:
        ⌈logical steps · expected logical batch size / max_physical_batch_size⌉."""
        steps = len(self.data_loader)
        return max(steps, math.ceil(steps * self.data_loader.expected_batch_size / self.max_physical_batch_size))

    def __iter__(self) -> Iterator[Any]:
        loader = self.data_loader
        previous = loader.max_physical_batch_size
        loader.max_physical_batch_size = self.max_physical_batch_size  # read by the loader for each batch
        try:
            yield from loader
        finally:
            loader.max_physical_batch_size = previous


class BatchMemoryManager:
    """Opacus' ``BatchMemoryManager`` interface on dpzoo's engine (see the module docstring).

    ``data_loader`` and ``optimizer`` must be the loader and the :class:`DPOptimizer` one
    ``dpzoo.PrivacyEngine.make_private`` returned together; entering gives a
    :class:`PhysicalBatchLoader` to iterate instead of ``data_loader``.
    """

    def __init__(self, *, data_loader: DPDataLoader, max_physical_batch_size: int, optimizer: DPOptimizer):
        if not isinstance(optimizer, DPOptimizer) or not isinstance(data_loader, DPDataLoader):
            given = optimizer if not isinstance(optimizer, DPOptimizer) else data_loader
            raise PrivacyUsageError(
                f"dpzoo's BatchMemoryManager needs the optimizer and data loader dpzoo's make_private returned, got "
                f"{type(given).__module__}.{type(given).__name__}. For Opacus' PrivacyEngine use "
                "opacus.utils.batch_memory_manager.BatchMemoryManager."
            )
        k = getattr(getattr(data_loader.batch_sampler, "units", None), "max_examples", None)
        if isinstance(max_physical_batch_size, int) and k is not None and k > max_physical_batch_size:
            raise PrivacyUsageError(
                f"max_physical_batch_size={max_physical_batch_size} is below max_examples_per_user={k}: a user's "
                "examples are clipped together in one micro-batch. Use max_physical_batch_size >= k."
            )
        if optimizer.signal is not data_loader.signal:
            raise PrivacyUsageError(
                "This optimizer and data loader come from different make_private calls: the optimizer would not "
                "see where the loader's logical batches end. Pass the pair one make_private returned."
            )
        if (
            not isinstance(max_physical_batch_size, numbers.Integral)
            or isinstance(max_physical_batch_size, bool)
            or max_physical_batch_size < 1
        ):
            raise PrivacyUsageError(
                f"max_physical_batch_size must be a positive integer, got {max_physical_batch_size!r}: pass the "
                "largest physical batch that fits in memory."
            )
        self.data_loader: DPDataLoader = data_loader
        self.optimizer: DPOptimizer = optimizer
        self.max_physical_batch_size: int = int(max_physical_batch_size)

    def __enter__(self) -> PhysicalBatchLoader:
        return PhysicalBatchLoader(self.data_loader, self.max_physical_batch_size)

    def __exit__(self, exc_type, exc, traceback) -> None:
        return None
