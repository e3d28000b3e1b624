"""Shape helpers shared by the rules (token and channel layouts, partial sums)."""

from __future__ import annotations

import torch


def tokens_last(x: torch.Tensor) -> torch.Tensor:
    """(B, ..., C) → (B, T, C): every position between batch and features is a token."""
    return x.reshape(x.shape[0], -1, x.shape[-1])


def channels_to_last(x: torch.Tensor) -> torch.Tensor:
    """(B, C, *spatial) → (B, T, C)."""
    return x.reshape(x.shape[0], x.shape[1], -1).transpose(1, 2)


def sum_all_but(x: torch.Tensor, keep: int) -> torch.Tensor:
    """Sum (B, ..., features) over the middle dims, keeping the last ``keep`` dims; half-precision
    values are summed into float32."""
    dims = tuple(range(1, x.dim() - keep))
    if x.dtype in (torch.float16, torch.bfloat16):
        return x.sum(dims, dtype=torch.float32) if dims else x.float()
    return x.sum(dims) if dims else x
