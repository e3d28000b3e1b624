"""A synthetic long-tailed sequence generator: the built-in default for quick starts and tests.

Item popularity is Zipf-distributed (rank r drawn with probability ∝ r^-alpha), the regime
DPFormer's Re-Attention targets (§5: rare tokens get a large effective DP error). Sequences
have learnable structure: with probability ``p_follow`` the next item is the previous item's
fixed "successor", otherwise a fresh Zipf draw, so a next-item model can beat popularity.
"""

from __future__ import annotations

import torch

from ..errors import InvalidArgumentError

__all__ = ["zipf_interactions"]


def zipf_interactions(
    num_users: int = 500,
    num_items: int = 300,
    min_len: int = 5,
    max_len: int = 40,
    alpha: float = 1.1,
    p_follow: float = 0.6,
    seed: int = 0,
) -> list[tuple[int, int, int]]:
    """(user, item, timestamp) triples, users 1..num_users, items 1..num_items."""
    if num_users < 1 or num_items < 2 or not 1 <= min_len <= max_len or alpha <= 0 or not 0 <= p_follow <= 1:
        raise InvalidArgumentError(
            f"zipf_interactions got num_users={num_users}, num_items={num_items}, min_len={min_len}, "
            f"max_len={max_len}, alpha={alpha}, p_follow={p_follow}; pass num_users >= 1, num_items >= 2, "
            "1 <= min_len <= max_len, alpha > 0 and 0 <= p_follow <= 1."
        )
    g = torch.Generator().manual_seed(seed)
    popularity = torch.arange(1, num_items + 1, dtype=torch.float64).pow(-alpha)
    popularity /= popularity.sum()
    successor = torch.randperm(num_items, generator=g) + 1  # item i -> successor[i - 1]
    out = []
    for user in range(1, num_users + 1):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        item = int(torch.multinomial(popularity, 1, generator=g)) + 1
        for t in range(length):
            out.append((user, item, t))
            if torch.rand(1, generator=g).item() < p_follow:
                item = int(successor[item - 1])
            else:
                item = int(torch.multinomial(popularity, 1, generator=g)) + 1
    return out
