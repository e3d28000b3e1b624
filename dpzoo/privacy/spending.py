"""Spending links: what a model and each layer it trains has spent, kept on the modules by the
engines that trained them (``dpzoo_spending``), so that a later run composes it.

A :class:`SpendingLink` holds the engine's accountant (it outlives the engine); a deep copy of a
model gets a :class:`FollowingSpending` (what the source stood for at the copy, and the source
from then on); PEFT's combination of adapters a :class:`ComposedSpending`; a model ``dpzoo.load``
read a :class:`RecordSpending` of its saved record. Every link is updated in place by the next
engine (:meth:`SpendingLink.relink`), so the copies that follow it follow along. Each link says
which runs it stands for through :func:`dpzoo.privacy.provenance.link_parts`; what a model
carries in all is composed in :mod:`dpzoo.privacy.carried`.
"""

from __future__ import annotations

from .accounting.accountant import Accountant
from .provenance import distinct_histories, link_parts

__all__ = ["SpendingLink", "FollowingSpending", "ComposedSpending", "RecordSpending"]


class SpendingLink:
    """What a model has spent, kept on the model by every engine that trains it
    (``model.dpzoo_spending``): the engine's accountant itself, so the record outlives the engine
    (a new engine on the same model composes after it). A ``copy.deepcopy`` gets a
    :class:`FollowingSpending` of it. A later engine on the module updates the link in place
    (:meth:`relink`), so the copies that follow it follow that engine too."""

    def __init__(self, accountant: Accountant):
        self.accountant = accountant

    def __deepcopy__(self, memo: dict) -> "SpendingLink":
        return FollowingSpending(self)

    def relink(self, accountant: Accountant) -> None:
        """From now on, ``accountant``'s spending (a run that composed what this link stood for)."""
        if getattr(self, "accountant", None) is not accountant:
            self.kept: list = []  # what a run on data stated disjoint left uncomposed: a later run composes it
        self.accountant = accountant

    @property
    def history(self) -> list:
        return list(distinct_histories(link_parts(self)))


class FollowingSpending(SpendingLink):
    """A deep copy's spending: what its source link stood for when the copy was made, and the
    source's spending from then on (an EMA / SWA copy averages iterates that go on spending, also
    when a later engine trains the original, even on data stated disjoint), until an engine trains
    the copy itself (:meth:`relink`), which leaves the source alone."""

    def __init__(self, source: SpendingLink):
        self.source = source
        self.at_copy = [(key, segments, [list(h) for h in history]) for key, segments, history in link_parts(source)]

    def relink(self, accountant: Accountant) -> None:
        self.source = SpendingLink(accountant)


class ComposedSpending(SpendingLink):
    """The spending of weights made from several linked ones (PEFT's ``add_weighted_adapter`` of
    adapters different engines trained): every part's history, composed."""

    def __init__(self, parts: list):
        self.parts = parts

    def relink(self, accountant: Accountant) -> None:
        self.parts = [SpendingLink(accountant)]


class RecordSpending(SpendingLink):
    """The spending of a saved record ``dpzoo.load`` read (its parts), kept as a link too: the
    record attribute (``dpzoo_privacy``) is where the user states ``{}``, which must not erase it."""

    def __init__(self, parts: list, delta: float | None = None):
        self.recorded, self.delta = parts, delta  # the record's δ (an adapter's record made from links uses it)

    def relink(self, accountant: Accountant) -> None:
        self.recorded = []  # the run that relinks composed it (or keeps it, for data stated disjoint)
        SpendingLink.relink(self, accountant)
