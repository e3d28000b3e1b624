"""Which spending a model carries, each run once.

A model can carry several records of what was spent on its data: the spending link of every
engine that trained it or one of its layers (:class:`~dpzoo.privacy.budget.SpendingLink`,
``OpacusSpending``, ``ComposedSpending``), records ``dpzoo.load`` attached, the record of a
Hugging Face config. Composing all of them would count twice a run that a later run already
composed; dropping one whose history merely *equals* another's would lose an independent run
(two layers from two DP runs with the same settings). So links are told apart by identity: each
accountant gets a run id, and the engine that composes links records their ids
(:func:`note_composed`); a link whose run another link composed is dropped, every other link is
kept. Records (snapshots without identity) are dropped when a kept history contains them.
"""

from __future__ import annotations

import uuid
from typing import Any, Iterable

__all__ = ["run_id", "link_parts", "note_composed", "distinct_histories"]


def run_id(accountant: Any) -> str:
    """The run id of an accountant (dpzoo's or Opacus'), given on first use."""
    rid = getattr(accountant, "dpzoo_run_id", None)
    if rid is None:
        rid = uuid.uuid4().hex
        accountant.dpzoo_run_id = rid
    return rid


def link_parts(link: Any) -> list[tuple[str, set, list]]:
    """(run id, runs it composed, history) of each run a spending link stands for."""
    parts = getattr(link, "parts", None)
    if parts is not None:  # ComposedSpending: several runs
        return [p for part in parts for p in link_parts(part)]
    opacus = getattr(link, "opacus", None)
    if opacus is not None:  # OpacusSpending: Opacus' own steps, after the link it found (not composed by Opacus)
        earlier = getattr(link, "earlier", None)
        own = [[float(s), float(q), int(n)] for s, q, n in opacus.history]
        return (link_parts(earlier) if earlier is not None else []) + ([(run_id(opacus), set(), own)] if own else [])
    accountant = getattr(link, "accountant", None)
    if accountant is None or not getattr(link, "history", None):
        return []
    return [(run_id(accountant), set(getattr(accountant, "dpzoo_composed", ())), link.history)]


def note_composed(accountant: Any, links: Iterable[Any]) -> None:
    """Record on ``accountant`` that its history composed the runs of ``links`` (and theirs)."""
    composed = set(getattr(accountant, "dpzoo_composed", ()))
    own = run_id(accountant)
    for link in links:
        for key, more, _ in link_parts(link):
            if key != own:
                composed |= {key} | more
    accountant.dpzoo_composed = composed


def distinct_histories(links: Iterable[Any], records: Iterable[list]) -> list:
    """Every run the ``links`` stand for once (the longest history of each run, none that another
    composed), then every record history no kept history contains; composed into one history."""
    runs: dict[str, tuple[set, list]] = {}
    for link in links:
        for key, composed, history in link_parts(link):
            if key not in runs or len(history) > len(runs[key][1]):
                runs[key] = (composed, history)
    composed_by_others = set().union(*(c for c, _ in runs.values())) if runs else set()
    kept = [[list(h) for h in history] for key, (_, history) in runs.items() if key not in composed_by_others]
    for history in sorted((r for r in records if r), key=len, reverse=True):
        if not any(k[i : i + len(history)] == history for k in kept for i in range(len(k) - len(history) + 1)):
            kept.append(history)
    return [entry for history in kept for entry in history]
