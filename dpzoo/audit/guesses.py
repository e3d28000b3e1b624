"""The auditor's guesses: canary scores to correct guesses, and the best bound over the guess counts.

Algorithm 1 of Steinke, Nasr & Jagielski (2023), steps 3–4: the auditor guesses "in" for the
k+ highest scores, "out" for the k- lowest and abstains on the rest (guesses T ∈ {-1, 0, +1}^m,
r = k+ + k- guesses); v correct guesses give a lower bound on ε (:mod:`dpzoo.audit.bound`).

Choosing k after looking at the scores is a choice among several tests: dpzoo tries a fixed
grid of guess counts (:data:`DEFAULT_GUESS_FRACTIONS` of m) and applies a Bonferroni correction
(each is tested at β / grid size), so the reported confidence holds for the best of them
(:func:`best_guesses`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .bound import epsilon_lower_bound

__all__ = ["DEFAULT_GUESS_FRACTIONS", "guess_counts", "correct_guesses", "best_guesses"]

# total guesses r as fractions of m (balanced: k+ = ⌊r/2⌋ "in", the rest "out"); Bonferroni over these
DEFAULT_GUESS_FRACTIONS = (0.05, 0.1, 0.2, 0.4, 0.7, 0.9)


def guess_counts(m: int, fractions: Sequence[float]) -> list[tuple[int, int]]:
    """The distinct (k+, k-) to try: r = ``fraction`` · m guesses (at least 2, at most m), split
    evenly, k+ = ⌊r/2⌋ "in" and the rest "out"."""
    out = []
    for f in fractions:
        r = max(2, min(m, round(f * m)))
        pair = (r // 2, r - r // 2)
        if pair not in out:
            out.append(pair)
    return out


def correct_guesses(
    scores: torch.Tensor, included: torch.Tensor, k_plus: int, k_minus: int, generator: torch.Generator
) -> int:
    """Correct guesses when the k+ highest scores are guessed in and the k- lowest out (ties
    broken at random: a random permutation, then a stable sort)."""
    perm = torch.randperm(len(scores), generator=generator)
    order = perm[torch.sort(scores[perm], descending=True, stable=True).indices]
    guessed_in, guessed_out = order[:k_plus], order[len(order) - k_minus :]
    return int(included[guessed_in].sum()) + int((~included[guessed_out]).sum())


def best_guesses(
    scores: torch.Tensor,
    included: torch.Tensor,
    delta: float,
    confidence: float,
    guess_fractions: Sequence[float],
    generator: torch.Generator,
) -> tuple[list[dict], dict, float]:
    """Every guess count of the grid scored and bounded at (1 - confidence) / grid size.

    Returns (candidates: a dict per (k+, k-) with its ``correct`` guesses and
    ``epsilon_lower_bound``; the best of them: the strongest bound, among equal ones the most
    guesses; the most this audit can show: the bound if every guess were right). ``generator``
    breaks ties, one permutation per guess count in grid order.
    """
    m = len(scores)
    beta = 1 - confidence
    counts = guess_counts(m, guess_fractions)
    level = beta / len(counts)  # Bonferroni over the tried guess counts
    candidates = []
    for k_plus, k_minus in counts:
        v = correct_guesses(scores, included, k_plus, k_minus, generator)
        candidates.append(
            {
                "k_plus": k_plus,
                "k_minus": k_minus,
                "correct": v,
                "epsilon_lower_bound": epsilon_lower_bound(m, k_plus + k_minus, v, delta, level),
            }
        )
    # the strongest bound; among equal ones (e.g. all 0) the most guesses, the most informative line
    best = max(candidates, key=lambda c: (c["epsilon_lower_bound"], c["k_plus"] + c["k_minus"]))
    max_auditable = max(epsilon_lower_bound(m, a + b, a + b, delta, level) for a, b in counts)
    return candidates, best, max_auditable
