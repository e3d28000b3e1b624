"""Ranking metrics for next-item prediction: NDCG@k and HIT@k over the full item set.

Decisions (the DPFormer paper reports NDCG@10 and HIT@10 without fixing these details):

* the true next item is ranked against **all** items (no sampled negatives); column 0 of the
  scores is the padding id and never ranked;
* items already in the user's history are **excluded** from the ranking (their scores set to
  -inf) unless they are the target itself, as in common full-ranking evaluation of sequential
  recommenders: on MovieLens a user rates a movie once, so a history item cannot be next
  (``exclude_history=False`` ranks them too);
* ties count **against** the target (rank = items scoring higher + other items scoring equal),
  so a model that outputs constant scores gets no credit.

With the 0-based rank r of the target: HIT@k = [r < k], NDCG@k = [r < k] / log2(r + 2).
"""

from __future__ import annotations

import math

import torch

from ..errors import InvalidArgumentError

__all__ = ["target_ranks", "ndcg_hit_at_k"]


def target_ranks(
    scores: torch.Tensor, targets: torch.Tensor, history: torch.Tensor | None = None, exclude_history: bool = True
) -> torch.Tensor:
    """0-based rank of each target among all items.

    Args:
        scores: (N, V + 1) scores; column 0 is the padding id.
        targets: (N,) item ids in 1..V.
        history: (N, L) item ids the user interacted with before (0 = padding), or None.
    """
    if scores.dim() != 2 or targets.dim() != 1 or scores.shape[0] != targets.shape[0]:
        raise InvalidArgumentError(
            f"scores must be (N, V+1) and targets (N,), got {tuple(scores.shape)} and "
            f"{tuple(targets.shape)}; pass one row of scores per target."
        )
    if (targets < 1).any() or (targets >= scores.shape[1]).any():
        raise InvalidArgumentError(
            "targets must be item ids in 1..V, where V + 1 is the number of score columns "
            "(0 is padding); drop padded targets or widen scores."
        )
    s = scores.detach().clone().float()
    s[:, 0] = -math.inf
    if exclude_history and history is not None:
        hist = history.clone()
        hist[hist == targets.unsqueeze(1)] = 0  # the target itself stays ranked
        s.scatter_(1, hist, -math.inf)
        s[:, 0] = -math.inf
    t = s.gather(1, targets.unsqueeze(1))
    higher = (s > t).sum(1)
    ties = (s == t).sum(1) - 1  # other items with the same score
    return higher + ties


def ndcg_hit_at_k(ranks: torch.Tensor, k: int = 10) -> tuple[float, float]:
    """(mean NDCG@k, mean HIT@k) from 0-based ranks."""
    ranks = ranks.to(torch.float64)
    hit = (ranks < k).to(torch.float64)
    ndcg = hit / torch.log2(ranks + 2)
    return ndcg.mean().item(), hit.mean().item()
