"""The sequence dataset: per-user item sequences with SASRec's leave-one-out split, padded into
tensors, and SASRec's preprocessing that builds one from ``(user, item, timestamp)`` rows.

DPFormer (a Transformer for next-item prediction) is trained with *user-level* DP: one
user's whole sequence is one sample. Rows become per-user item sequences the way SASRec
(Kang & McAuley, 2018) does::

    rows = read_grouplens_ratings("ratings.dat")     # dpzoo.seqrec.formats
    ds = sasrec_preprocess(rows, min_count=5)        # SequenceDataset
    x, y = ds.to_padded(200, part="train")           # (U, 200) inputs / targets

Conventions: users and items are renumbered 1..N; item id 0 is the padding id.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Iterator, Sequence, cast

import torch

from dpzoo.errors import DPZooError

from .formats import read_interactions

__all__ = ["SequenceDataset", "sasrec_preprocess", "dataset_from_file"]


class SequenceDataset:
    """Per-user item sequences (1-based item ids, 0 = padding) with a leave-one-out split.

    ``sequences[u - 1]`` is user ``u``'s time-ordered item sequence. For each user with
    at least 3 items the last item is the test target, the second-to-last the validation
    target and the rest the training part (as in SASRec). Users with fewer than 3 items
    are all training and have no validation/test target (SASRec does the same).

    ``item_counts`` (LongTensor of length ``num_items + 1``, index 0 = 0) counts each
    item over the *training* parts only, so no held-out item leaks into token frequencies.
    """

    def __init__(
        self,
        sequences: Sequence[Sequence[int]],
        num_items: int | None = None,
        user_ids: Sequence | None = None,
        item_ids: Sequence | None = None,
        name: str | None = None,
    ):
        self.sequences = [list(map(int, s)) for s in sequences]
        top = max((max(s) for s in self.sequences if s), default=0)
        low = min((min(s) for s in self.sequences if s), default=1)
        if low < 1:
            raise DPZooError("Item ids must be >= 1 (0 is the padding id).")
        self.num_items = int(num_items) if num_items is not None else top
        if top > self.num_items:
            raise DPZooError(f"Item id {top} exceeds num_items={self.num_items}.")
        self.num_users = len(self.sequences)
        self.user_ids = list(user_ids) if user_ids is not None else None  # original ids
        self.item_ids = list(item_ids) if item_ids is not None else None  # item_ids[k-1]
        self.name = name
        counts = torch.zeros(self.num_items + 1, dtype=torch.long)
        for s in self.train_sequences():
            if s:
                counts += torch.bincount(torch.tensor(s), minlength=self.num_items + 1)
        self.item_counts = counts

    def __len__(self) -> int:
        return self.num_users

    def __repr__(self) -> str:
        s = self.summary()
        label = f"{self.name!r}, " if self.name else ""
        return (
            f"SequenceDataset({label}users={s['users']}, items={s['items']}, "
            f"interactions={s['interactions']}, avg_len={s['avg_len']:.1f})"
        )

    # -- split
    def train_sequences(self) -> list[list[int]]:
        """Training part of every user (all users, in user order; may be short)."""
        return [s[:-2] if len(s) >= 3 else list(s) for s in self.sequences]

    def validation_targets(self) -> dict[int, int]:
        """{user (1-based): validation item} for users with >= 3 items."""
        return {u: s[-2] for u, s in enumerate(self.sequences, 1) if len(s) >= 3}

    def test_targets(self) -> dict[int, int]:
        """{user (1-based): test item} for users with >= 3 items."""
        return {u: s[-1] for u, s in enumerate(self.sequences, 1) if len(s) >= 3}

    def summary(self) -> dict:
        n = sum(len(s) for s in self.sequences)
        return {
            "users": self.num_users,
            "items": self.num_items,
            "interactions": n,
            "avg_len": n / self.num_users if self.num_users else 0.0,
        }

    # -- tensors
    def padded_users(self, part: str = "train") -> torch.Tensor:
        """User ids (1-based) of the rows :meth:`to_padded` returns for `part`."""
        return torch.tensor([u for u, _, _ in self._examples(part)], dtype=torch.long)

    def _examples(self, part: str) -> Iterator[tuple[int, list[int], list[int] | int]]:
        if part == "train":
            for u, s in enumerate(self.train_sequences(), 1):
                if len(s) >= 2:  # at least one (input, next item) pair
                    yield u, s[:-1], s[1:]
        elif part in ("valid", "test"):
            for u, s in enumerate(self.sequences, 1):
                if len(s) >= 3:
                    yield (u, s[:-2], s[-2]) if part == "valid" else (u, s[:-1], s[-1])
        else:
            raise DPZooError(f"part must be 'train', 'valid' or 'test', not {part!r}.")

    def to_padded(self, max_len: int, part: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) LongTensors for next-item prediction, left-padded with 0.

        * ``part="train"``: one row per user whose training part has >= 2 items;
          ``inputs = train[:-1]`` and ``targets = train[1:]`` (the next item at every
          position), both cut to their last `max_len` items and left-padded: shape
          ``(n, max_len)`` each; a target of 0 marks padding (ignore it in the loss).
        * ``part="valid"`` / ``"test"``: one row per user with >= 3 items; ``inputs`` is
          the history before the held-out item (training part for valid, training part +
          validation item for test), last `max_len`, shape ``(n, max_len)``; ``targets``
          is the held-out item, shape ``(n,)``.

        Rows are in user order; :meth:`padded_users` gives their user ids.
        """
        if int(max_len) < 1:
            raise DPZooError(f"max_len must be >= 1, not {max_len!r}.")
        max_len = int(max_len)
        ex = list(self._examples(part))
        inputs = torch.zeros(len(ex), max_len, dtype=torch.long)
        if part == "train":
            targets = torch.zeros(len(ex), max_len, dtype=torch.long)
        else:
            targets = torch.zeros(len(ex), dtype=torch.long)
        for r, (_, hist, tgt) in enumerate(ex):
            hist = hist[-max_len:]
            if hist:
                inputs[r, max_len - len(hist) :] = torch.tensor(hist)
            if part == "train":
                tgt = cast(list[int], tgt)[-max_len:]  # train: a list, the next item at every position
                targets[r, max_len - len(tgt) :] = torch.tensor(tgt)
            else:
                targets[r] = tgt
        return inputs, targets


# ----------------------------------------------------------------------------- preprocessing


def sasrec_preprocess(interactions: Iterable[Sequence], min_count: int = 5, name: str | None = None) -> SequenceDataset:
    """SASRec preprocessing of ``(user, item, timestamp)`` rows into a SequenceDataset.

    1. Filtering, **once** (not iterated to a fixed point), as SASRec's reference
       ``DataProcessing.py`` does: count each user's and each item's actions over *all*
       rows, then drop every row whose user or item has fewer than `min_count` actions.
       A kept user or item can therefore end up with fewer than `min_count` kept actions.
       ``min_count <= 1`` keeps everything.
    2. Each user's actions are sorted by timestamp; the sort is stable, so ties keep the
       order of the input rows (file order).
    3. Renumbering: users 1..U in order of first appearance among the kept rows; items
       1..I in order of first appearance when walking users in that order, each through
       their *time-ordered* sequence. (SASRec's Amazon script numbers items in file order
       instead; the released ml-1m.txt, e.g. user 1 = items 1..53, follows time order,
       which is what this function reproduces.) Id 0 is reserved for padding.

    The original ids are kept in ``ds.user_ids`` / ``ds.item_ids`` (index k-1 for id k).
    """
    rows = [(r[0], r[1], r[2]) for r in interactions]
    if min_count > 1:
        cu = Counter(u for u, _, _ in rows)
        ci = Counter(i for _, i, _ in rows)
        rows = [r for r in rows if cu[r[0]] >= min_count and ci[r[1]] >= min_count]
    by_user: dict = {}
    for u, i, t in rows:
        by_user.setdefault(u, []).append((t, i))
    item_map: dict = {}
    sequences = []
    for acts in by_user.values():
        acts.sort(key=lambda a: a[0])  # stable: ties keep input order
        seq = []
        for _, i in acts:
            k = item_map.get(i)
            if k is None:
                k = item_map[i] = len(item_map) + 1
            seq.append(k)
        sequences.append(seq)
    return SequenceDataset(
        sequences, num_items=len(item_map), user_ids=list(by_user), item_ids=list(item_map), name=name
    )


def dataset_from_file(
    path, min_count: int = 5, name: str | None = None, amazon_columns: str | None = None
) -> SequenceDataset:
    """A ratings file (format sniffed, see :func:`dpzoo.seqrec.formats.read_interactions`) as a
    SequenceDataset: SASRec text is already preprocessed (filtered, time-ordered, renumbered) and
    keeps its ids; every other format goes through :func:`sasrec_preprocess`."""
    fmt, rows = read_interactions(path, amazon_columns)
    if fmt == "sasrec":
        by_user: dict = {}
        for u, i, _ in rows:
            by_user.setdefault(u, []).append(i)
        users = sorted(by_user)
        return SequenceDataset([by_user[u] for u in users], user_ids=users, name=name)
    return sasrec_preprocess(rows, min_count=min_count, name=name)
