"""NDCG@10 / HIT@10 on known rankings, and the synthetic long-tailed generator."""

import math
from collections import Counter

import pytest
import torch

from dpzoo.errors import InvalidArgumentError
from dpzoo.seqrec.metrics import ndcg_hit_at_k, target_ranks
from dpzoo.seqrec.synthetic import zipf_interactions


def test_ranks_on_known_scores():
    # items 1..5 (column 0 is padding and must never count, even with a huge score)
    scores = torch.tensor([[100.0, 0.1, 0.5, 0.3, 0.9, 0.2], [100.0, 5.0, 4.0, 3.0, 2.0, 1.0]])
    targets = torch.tensor([3, 1])
    ranks = target_ranks(scores, targets, exclude_history=False)
    assert ranks.tolist() == [2, 0]  # 0.3 is third after 0.9 and 0.5; item 1 is first
    ndcg, hit = ndcg_hit_at_k(ranks, k=10)
    assert ndcg == pytest.approx((1 / math.log2(4) + 1 / math.log2(2)) / 2)
    assert hit == 1.0
    _, hit2 = ndcg_hit_at_k(ranks, k=2)
    assert hit2 == 0.5


def test_history_items_are_excluded_but_not_the_target():
    scores = torch.tensor([[0.0, 0.1, 0.5, 0.3, 0.9, 0.2]])
    history = torch.tensor([[0, 4, 2, 3]])  # padded; includes the target 3 (a repeat)
    r = target_ranks(scores, torch.tensor([3]), history)
    assert r.tolist() == [0]  # 0.9 (item 4) and 0.5 (item 2) removed; item 3 still ranked
    assert target_ranks(scores, torch.tensor([3]), history, exclude_history=False).tolist() == [2]


def test_ties_count_against_the_target():
    scores = torch.zeros(1, 21)
    ranks = target_ranks(scores, torch.tensor([7]), exclude_history=False)
    assert ranks.tolist() == [19]  # constant scores: last place, no credit
    assert ndcg_hit_at_k(ranks) == (0.0, 0.0)


def test_rank_beyond_k_gives_zero():
    scores = torch.arange(30, dtype=torch.float32).flip(0).unsqueeze(0)  # item i scores 29 - i
    ranks = target_ranks(scores, torch.tensor([15]), exclude_history=False)
    assert ranks.tolist() == [14]
    assert ndcg_hit_at_k(ranks, 10) == (0.0, 0.0)


def test_bad_inputs_are_rejected():
    with pytest.raises(InvalidArgumentError, match="1..V"):
        target_ranks(torch.zeros(1, 5), torch.tensor([0]))
    with pytest.raises(InvalidArgumentError, match="N, V\\+1"):
        target_ranks(torch.zeros(5), torch.tensor([1]))


def test_zipf_generator_is_long_tailed_reproducible_and_learnable():
    a = zipf_interactions(num_users=300, num_items=200, seed=1)
    assert a == zipf_interactions(num_users=300, num_items=200, seed=1)
    counts = Counter(i for _, i, _ in a)
    top = sum(c for _, c in counts.most_common(20))
    assert top / len(a) > 0.3  # 10% of items carry a large share: long tail
    users = Counter(u for u, _, _ in a)
    assert min(users.values()) >= 5 and max(users.values()) <= 40
    # structure: the most frequent successor of an item is far more common than chance
    pairs = Counter((x[1], y[1]) for x, y in zip(a, a[1:]) if x[0] == y[0])
    follow = sum(c for (p, n), c in pairs.items() if c == max(cc for (pp, _), cc in pairs.items() if pp == p))
    assert follow / sum(pairs.values()) > 0.4
