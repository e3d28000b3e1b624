"""Which spending a model carries, each run's steps once.

A model can carry several records of what was spent on its data: the spending link of every
engine that trained it or one of its layers (:class:`~dpzoo.privacy.spending.SpendingLink`,
``OpacusSpending``, ``ComposedSpending``), records ``dpzoo.load`` attached, the record of a
Hugging Face config, an optimizer checkpoint. Composing all of them would count twice the steps
a later run already composed; dropping one whose history merely *equals* another's would lose an
independent run (two layers from two DP runs with the same settings). So runs are told apart by
identity, never by value: each accountant gets a run id, and every history is split into the
runs it is made of, in order (its *segments*: ``[[run id, steps], ...]``). A run composed
before this one's own steps is recorded as such when its history is composed (``composed_runs``
in records and checkpoints; the steps after them are the run's own). Composing several histories
keeps, of each run, the most steps any of them holds (a copy trained on from step 50 of a run
that went on to step 100 keeps that run's 100 steps once, and its own). Histories without a run
id (hand-written or older records) are dropped only when the kept history contains them.
"""

from __future__ import annotations

import uuid
import weakref
from typing import Any, Iterable, Mapping

from ..errors import PrivacyUsageError

__all__ = ["run_id", "new_run", "segments_of", "link_parts", "record_part", "distinct_histories", "Spent", "steps_of",
           "first_steps", "after_steps", "record_parts", "history_of"]  # fmt: skip


class Spent(list):
    """A composed history with its :attr:`segments` (``[[run id or None, steps], ...]``, in order)."""

    segments: list


_BY_IDENTITY: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


def run_id(accountant: Any) -> str:
    """The run id of an accountant, given on first use. dpzoo's ``Accountant`` keeps it as an
    attribute (its ``__setstate__`` makes a pickled or deep copy a run of its own); any other
    (Opacus') is named by identity, so a copy of it, which goes on apart, is another run."""
    if not getattr(type(accountant), "dpzoo_keeps_run_id", False):
        try:
            return _BY_IDENTITY.setdefault(accountant, uuid.uuid4().hex)
        except TypeError:  # not weakly referable: an attribute, as dpzoo's
            pass
    rid = getattr(accountant, "dpzoo_run_id", None)
    if rid is None:
        rid = uuid.uuid4().hex
        accountant.dpzoo_run_id = rid
    return rid


def new_run(accountant: Any) -> str:
    """Give ``accountant`` a new run id: its history was replaced (a checkpoint loaded over it), so
    what it holds from now on is not the run its earlier records and links name."""
    rid = uuid.uuid4().hex
    if getattr(type(accountant), "dpzoo_keeps_run_id", False):
        accountant.dpzoo_run_id = rid
    else:
        try:
            _BY_IDENTITY[accountant] = rid
        except TypeError:
            accountant.dpzoo_run_id = rid
    return rid


def steps_of(history: list) -> int:
    return sum(int(h[2]) for h in history)


def first_steps(history: list, keep: int) -> list:
    """The first ``keep`` steps of ``history``."""
    out = []
    for h in history:
        if keep <= 0:
            break
        out.append([h[0], h[1], min(keep, int(h[2])), *h[3:]])
        keep -= int(h[2])
    return out


def after_steps(history: list, skip: int) -> list:
    """``history`` without its first ``skip`` steps."""
    out = []
    for h in history:
        drop = min(skip, int(h[2]))
        skip -= drop
        if int(h[2]) > drop:
            out.append([h[0], h[1], int(h[2]) - drop, *h[3:]])
    return out


def segments_of(key: str, earlier: list | None, history: list) -> list:
    """The segments of a run ``key`` whose history composed ``earlier`` segments first: those, then
    the rest of the history as the run's own."""
    earlier = [list(s) for s in earlier or []]
    own = steps_of(history) - sum(int(n) for _, n in earlier)
    return earlier + ([[key, own]] if own > 0 else [])


def link_parts(link: Any) -> list[tuple]:
    """(run id, segments, history) of each run a spending link stands for."""
    kept = list(getattr(link, "kept", None) or [])  # what a run on data stated disjoint did not compose
    return kept + _own_parts(link)


def _own_parts(link: Any) -> list[tuple]:
    recorded = list(getattr(link, "recorded", None) or [])  # RecordSpending: a saved record's runs
    if recorded or hasattr(link, "recorded") and getattr(link, "accountant", None) is None:
        return recorded
    source = getattr(link, "source", None)
    if source is not None:  # a deep copy's link: the source's runs when copied, and live
        return list(getattr(link, "at_copy", [])) + link_parts(source)
    parts = getattr(link, "parts", None)
    if parts is not None:  # ComposedSpending: several runs
        return [p for part in parts for p in link_parts(part)]
    if hasattr(link, "opacus"):  # OpacusSpending: Opacus' own steps, after the link it found (not composed by Opacus)
        opacus, earlier = link.opacus, getattr(link, "earlier", None)
        own = [[float(s), float(q), int(n)] for s, q, n in opacus.history] if opacus is not None else []
        key = run_id(opacus) if own else ""
        before = list(getattr(opacus, "dpzoo_earlier_parts", None) or [])  # a checkpoint's model's too
        before += list(getattr(opacus, "dpzoo_stated_parts", None) or [])  # records the user stated for adapters
        return (
            (link_parts(earlier) if earlier is not None else [])
            + before
            + ([(key, segments_of(key, getattr(opacus, "dpzoo_segments", None), own), own)] if own else [])
        )
    accountant = getattr(link, "accountant", None)
    history = [list(h) for h in getattr(accountant, "history", None) or []]
    if not history:
        return []
    key = run_id(accountant)
    return [(key, segments_of(key, getattr(accountant, "dpzoo_segments", None), history), history)]


def record_part(meta: dict, history: list) -> tuple:
    """The part of a saved record or checkpoint: its run id and segments when it carries a run id
    (``composed_runs``: the segments before the run's own steps), else anonymous."""
    key = meta.get("run_id")
    if not (isinstance(key, str) and key):
        return (None, None, history)
    return (key, segments_of(key, meta.get("composed_runs"), history), history)


def record_parts(meta: Mapping) -> list:
    """The parts (:mod:`dpzoo.privacy.provenance`) of a privacy record: its own history, and the
    spending a run on data stated disjoint carried but did not compose (``disjoint_spending``)."""
    meta = dict(meta)
    parts = [record_part(meta, history_of(meta))]
    disjoint = meta.get("disjoint_spending")
    if isinstance(disjoint, Mapping) and disjoint.get("history"):
        parts.append(record_part(dict(disjoint), [list(h) for h in disjoint["history"]]))
    return parts


def history_of(meta: dict) -> list:
    """The (σ, q, steps) history of a privacy record: the whole one when recorded, else its last
    σ, q and step count; refused when it has no σ to compose with."""
    history = meta.get("history")
    if history or (isinstance(history, list) and not meta.get("steps")):  # every release, not only the last (σ, q)
        return [list(h) for h in history]  # [] for a run that has not stepped yet (a live config record)
    if meta.get("noise_multiplier") is None or not meta.get("steps"):
        raise PrivacyUsageError(
            f"This model was trained with DP before (ε = {meta.get('epsilon')}) but its metadata lacks the noise "
            "multiplier to compose with: pass accountant=Accountant(name, history) with the earlier steps, or set "
            "model.dpzoo_privacy = {} if the new data is disjoint from the data it was trained on."
        )
    return [[float(meta["noise_multiplier"]), float(meta["sample_rate"]), int(meta["steps"])]]


def distinct_histories(parts: Iterable[tuple]) -> Spent:
    """Every run the ``parts`` hold, once: the most steps any part holds of it (in the order runs are
    first seen), then every anonymous history the result does not contain; one history, with its
    segments."""
    own: dict[str, list] = {}
    anonymous = []
    for key, segments, history in parts:
        if key is None or segments is None:
            anonymous.append([list(h) for h in history])
            continue
        pieces: dict[str, list] = {}
        offset = 0
        for i, (rid, n) in enumerate(segments):
            piece = first_steps(after_steps(history, offset), int(n))
            offset += int(n)
            # an anonymous run inside a run's record sits apart from that run's own steps: an id of its own
            rid = f"{key}-anonymous-{i}" if rid is None else rid
            pieces[rid] = pieces.get(rid, []) + piece
        for rid, piece in pieces.items():
            if rid not in own or steps_of(piece) > steps_of(own[rid]):
                own[rid] = piece
    kept = [(rid, piece) for rid, piece in own.items() if piece]
    for history in sorted((r for r in anonymous if r), key=len, reverse=True):
        if not any(_contains(piece, history) for _, piece in kept):  # within one run's steps, never across runs
            kept.append((None, history))
    out = Spent(
        _merged([h for _, piece in kept for h in piece])
    )  # equal (σ, q) in one entry, as the accountant keeps them
    out.segments = [[rid, steps_of(piece)] for rid, piece in kept]
    return out


def _contains(history: list, part: list) -> bool:
    """Whether ``part`` is a window of ``history``'s steps (entries of equal (σ, q) merged or not)."""
    history, part = _merged(history), _merged(part)
    kind = lambda h: [h[0], h[1], *h[3:]]  # noqa: E731
    n = len(part)
    for i in range(len(history) - n + 1):
        window = history[i : i + n]
        if [kind(h) for h in window] != [kind(h) for h in part]:
            continue
        inner_equal = all(window[j][2] == part[j][2] for j in range(1, n - 1))  # the ends may be longer
        if inner_equal and window[0][2] >= part[0][2] and window[-1][2] >= part[-1][2]:
            return True
    return False


def _merged(history: list) -> list:
    out: list = []
    for h in history:
        if out and [out[-1][0], out[-1][1], *out[-1][3:]] == [h[0], h[1], *h[3:]]:
            out[-1] = [out[-1][0], out[-1][1], out[-1][2] + h[2], *out[-1][3:]]
        else:
            out.append(list(h))
    return out
