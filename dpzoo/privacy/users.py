"""User-level DP: the privacy unit is a user, all of whose examples neighbouring datasets differ in.
Two ways to sample (Charles et al., "Fine-Tuning Large Language Models with User-Level
Differential Privacy", SaTML 2025, §3–4), each with its accounting:

* **user-level sampling** (``user_sampling="users"``, ULS): each logical step includes every user
  independently with probability q, then at most k of each included user's examples, chosen
  uniformly at random afresh each step. The examples of one user in the step are clipped
  together: the clipped quantity is their summed gradient, ‖C_U Σ_{i∈U} g_i‖ ≤ R
  (:mod:`dpzoo.grad_norms.units`). One user moves the step's sum by at most R, and only when
  sampled, with probability q: the Poisson-subsampled Gaussian with users in place of examples,
  so every accountant's ε for (σ, q over users, steps) is a user-level ε;
* **example-level sampling** (``user_sampling="examples"``, ELS): at most k examples of each user
  are kept for the whole run (chosen at random once), then examples are Poisson-sampled at q and
  clipped one by one. A user's j ~ Binomial(k, q) sampled examples move the sum by at most j·R:
  a mixture of Gaussians, which dp-accounting's PLD accounts tightly (the paper's ELS accountant;
  history entries [σ, q, steps, k], :mod:`dpzoo.privacy.accounting.backends`).

Which of a user's examples are taken depends on that user's data alone, so it is part of the
per-user mechanism. The loader keeps each user's examples next to each other in the batch (ULS)
and splits a logical batch into micro-batches only between users (a user's gradient must be whole
before its norm: :func:`dpzoo.privacy.data.split_between_users`).
"""

from __future__ import annotations

import hashlib
import numbers
import os
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ..errors import InvalidArgumentError
from .data import PoissonBatchSampler, secret_generator
from .distributed import world_and_rank

__all__ = ["UserUnits", "user_units", "UserPoissonBatchSampler", "USER_SAMPLING"]

PRIVACY_UNITS = ("sample", "user")
USER_SAMPLING = ("users", "examples")  # ULS, ELS (the module docstring)


@dataclass(frozen=True)
class UserUnits:
    """The users of a dataset: ``unit[i]`` is example i's user (0 … num_users − 1); ``kept``: the
    examples example-level sampling keeps (at most k per user; None for user-level sampling)."""

    unit: torch.Tensor  # (N,) long
    num_users: int
    max_examples: int  # k
    kept: torch.Tensor | None = None

    @property
    def population(self) -> int:
        """What q is a rate over: users (ULS), or the examples kept (ELS)."""
        return self.num_users if self.kept is None else len(self.kept)

    @property
    def rate_base(self) -> tuple[int, str]:
        """(N, what N counts) for q = batch_size / N."""
        return self.population, "users" if self.kept is None else "examples kept (at most k per user)"

    @property
    def group(self) -> int:
        """k of the accountant's entries: 1 for ULS (a user is one sampled unit), k for ELS."""
        return 1 if self.kept is None else self.max_examples

    def sampler(self, sample_rate: float, generator, rank: int = 0, world: int = 1) -> Sampler:
        """This rank's sampler: its users (ULS: a user's examples all on one rank) or its share of
        the kept examples (ELS), every one sampled at the global rate q."""
        if self.kept is None:
            return UserPoissonBatchSampler(self, sample_rate, None, generator, range(rank, self.num_users, world))
        return PoissonBatchSampler(len(self.unit), sample_rate, None, generator, self.kept[rank::world].tolist())

    def fingerprint(self) -> str:
        """The same on every rank iff (very likely) the ranks passed the same users and k."""
        data = self.unit.numpy().tobytes() + str((self.max_examples, self.kept is None)).encode()
        return hashlib.sha256(data + (b"" if self.kept is None else self.kept.numpy().tobytes())).hexdigest()

    def metadata(self) -> dict:
        how = "Poisson over users, at most k examples each" if self.kept is None else (
            "Poisson over examples, at most k per user in the whole run (chosen at random once)"
        )  # fmt: skip
        return {"privacy_unit": "user", "users": self.num_users, "max_examples_per_user": self.max_examples,
                "sampling": how}  # fmt: skip


def user_units(
    privacy_unit: str, user_ids, max_examples_per_user, n: int, max_physical: int | None, sampling: str, seed
) -> UserUnits | None:
    """Check make_private's user-level arguments; None for example-level DP (``"sample"``). For
    example-level sampling, the k examples kept per user are drawn from ``seed`` (None: secret)."""
    if privacy_unit not in PRIVACY_UNITS:
        raise InvalidArgumentError(f"privacy_unit must be one of {PRIVACY_UNITS}, got {privacy_unit!r}")
    if sampling not in USER_SAMPLING:
        raise InvalidArgumentError(f"user_sampling must be one of {USER_SAMPLING}, got {sampling!r}")
    if privacy_unit == "sample":
        if user_ids is not None or max_examples_per_user is not None or sampling != "users":
            raise InvalidArgumentError(
                "user_ids / max_examples_per_user / user_sampling need privacy_unit='user' (they would be ignored): pass it, "
                "or drop them for example-level DP."
            )
        return None
    if user_ids is None:
        raise InvalidArgumentError(
            "privacy_unit='user' needs user_ids: one user id per example of the dataset, in dataset order."
        )
    k = max_examples_per_user
    if not isinstance(k, numbers.Integral) or isinstance(k, bool) or k < 1:
        raise InvalidArgumentError(
            f"max_examples_per_user must be an integer >= 1 (k: the most examples of one user in a step), got {k!r}"
        )
    if max_physical is not None and k > max_physical and sampling == "users":
        raise InvalidArgumentError(
            f"max_examples_per_user={k} exceeds max_physical_batch_size={max_physical}: a user's examples are "
            "clipped together in one micro-batch, so the micro-batch must hold k examples."
        )
    if getattr(user_ids, "ndim", 1) != 1:
        raise InvalidArgumentError(f"user_ids must be 1-D (one id per example), got {user_ids.ndim} dimensions.")
    ids = list(user_ids.tolist() if hasattr(user_ids, "tolist") else user_ids)
    if len(ids) != n:
        raise InvalidArgumentError(
            f"user_ids has {len(ids)} entries for a dataset of {n} examples: give one per example."
        )
    missing = [i for i, u in enumerate(ids) if _missing(u)]
    if missing:
        raise InvalidArgumentError(
            f"user_ids is missing for example(s) {missing[:8]} ({len(missing)} in all): every example needs its user "
            "(an example without one cannot be accounted to anyone); drop those examples or give each its own id."
        )
    index: dict = {}
    try:
        unit = torch.tensor([index.setdefault(u, len(index)) for u in ids], dtype=torch.long)
    except TypeError as e:  # unhashable ids (lists, arrays)
        raise InvalidArgumentError(
            f"user_ids must be hashable values (str, int), got {type(e).__name__}: {e}"
        ) from None
    if sampling == "users":
        return UserUnits(unit, len(index), int(k))
    return UserUnits(unit, len(index), int(k), _keep_at_most(unit, int(k), _shared_generator(seed)))


def _shared_generator(seed: int | None) -> torch.Generator:
    """The generator of the k examples kept per user, seeded alike on every rank (each must keep the
    same examples): ``seed``, or 63 bits of OS entropy drawn on rank 0 and broadcast."""
    seed = seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    if world_and_rank()[0] > 1:
        box = [seed]
        dist.broadcast_object_list(box, src=0)
        seed = box[0]
    return torch.Generator().manual_seed(int(seed))


def _missing(u) -> bool:
    """None or a NaN of any type (float, numpy, Decimal, a 0-d tensor): no user."""
    if u is None:
        return True
    try:
        return bool(u != u)
    except (TypeError, ValueError, RuntimeError):
        return False


def _keep_at_most(unit: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """At most k examples of each user, uniformly at random (a random order, then each user's first k)."""
    order = torch.randperm(len(unit), generator=generator)
    by_user = order[torch.argsort(unit[order], stable=True)]
    counts = torch.bincount(unit)
    rank = torch.arange(len(unit)) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    return torch.sort(by_user[rank < k]).values


class UserPoissonBatchSampler(Sampler[list[int]]):
    """``steps`` batches: every user (of ``users``, default all) with probability ``sample_rate``,
    then at most k of their examples at random; each user's examples next to each other.
    After yielding a batch, :attr:`last_counts` holds the number of examples of each user in it."""

    def __init__(self, units: UserUnits, sample_rate: float, steps: int | None, generator=None, users=None):
        if not 0 < sample_rate <= 1:
            raise InvalidArgumentError(f"need 0 < sample_rate <= 1, got {sample_rate}")
        self.units, self.sample_rate, self.generator = units, sample_rate, generator
        self.steps = steps if steps is not None else max(1, round(1 / sample_rate))
        self.users = torch.arange(units.num_users) if users is None else torch.as_tensor(list(users), dtype=torch.long)
        order = torch.argsort(units.unit, stable=True)  # examples grouped by user
        counts = torch.bincount(units.unit, minlength=units.num_users)
        self._members, self._counts = order, counts
        self._starts = torch.cumsum(counts, 0) - counts
        self.last_counts: list[int] = []

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        gen = self.generator if self.generator is not None else secret_generator()
        k = self.units.max_examples
        for _ in range(self.steps):
            picked = self.users[torch.rand(len(self.users), generator=gen) < self.sample_rate]
            batch: list[int] = []
            counts: list[int] = []
            for u in picked.tolist():
                start, count = int(self._starts[u]), int(self._counts[u])
                rows = self._members[start : start + count]
                if count > k:
                    rows = rows[torch.randperm(count, generator=gen)[:k]]
                batch.extend(rows.tolist())
                counts.append(len(rows))
            self.last_counts = counts
            yield batch
