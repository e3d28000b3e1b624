"""The next-item networks (DPFormer paper §5, App. E.2), DP-ready: the causal Transformer and
the GRU / LSTM baselines.

A causal Transformer encoder over a user's item sequence (left-padded with 0): learned
positional embedding, ``num_blocks`` pre-norm blocks of single- or multi-head attention and a
feed-forward layer, and a full softmax over all items. With ``tied=True`` the output layer
reuses the input item embedding (one tensor, two uses: dpzoo's hooks give its exact
per-sample norm, Phantom Clipping). Attention is written with plain ``nn.Linear``
projections and an explicit softmax so every parameter has a per-sample rule and
Re-Attention (:mod:`dpzoo.seqrec.reattention`) can act on the scores: a block has one
forward, which takes an optional score correction and can return its intermediates;
Re-Attention wraps it (:class:`~dpzoo.seqrec.reattention.ReAttentionBlock`).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
from torch import nn

from ..errors import InvalidArgumentError
from ..nn.recurrent import DPGRU, DPLSTM
from .configuration import SeqRecConfig
from .reattention import ReAttention, ReAttentionBlock

__all__ = ["CausalSelfAttention", "Block", "BlockTrace", "SeqRecTransformer", "SeqRecRNN"]

# (attention input x, queries q (B, H, T, dk)) -> a term (B, H, T, T) to subtract from the logits
ScoreCorrection = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class BlockTrace(NamedTuple):
    """The intermediates of one :class:`Block` forward (what variance propagation reads)."""

    attn_input: torch.Tensor  # ln1(x)
    probs: torch.Tensor  # attention weights (B, H, T, T), after any score correction
    mixed: torch.Tensor  # probs @ v with the heads concatenated: the input of the output projection
    mid: torch.Tensor  # x + attention branch: the input of ln2
    ffn_input: torch.Tensor  # ln2(mid)
    pre: torch.Tensor  # ff1(ffn_input)
    act: torch.Tensor  # ReLU(pre)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: SeqRecConfig):
        super().__init__()
        if cfg.d_model % cfg.num_heads:
            raise InvalidArgumentError(
                f"d_model={cfg.d_model} is not divisible by num_heads={cfg.num_heads}; "
                "choose num_heads that divides d_model."
            )
        self.h, self.dk = cfg.num_heads, cfg.d_model // cfg.num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(cfg.d_model, cfg.d_model) for _ in range(4))
        self.drop = nn.Dropout(cfg.dropout)

    def scores(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.h, self.dk).transpose(1, 2)
        k = self.k(x).view(b, t, self.h, self.dk).transpose(1, 2)
        return q @ k.transpose(-2, -1) / math.sqrt(self.dk), q

    def forward(
        self,
        x: torch.Tensor,
        key_mask: torch.Tensor,
        score_correction: ScoreCorrection | None = None,
        return_trace: bool = False,
    ):
        """The attention output; ``score_correction(x, q)`` is subtracted from the logits before the
        softmax (Re-Attention, §5.2). With ``return_trace``: ``(output, probs, mixed)``."""
        b, t, d = x.shape
        s, q = self.scores(x)
        if score_correction is not None:
            s = s - score_correction(x, q)  # the scores stay in the graph (q and k train)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        allowed = causal & key_mask[:, None, None, :]
        s = s.masked_fill(~allowed, -1e9)  # finite: rows of padding stay finite (their loss is ignored)
        probs = torch.softmax(s, dim=-1)
        v = self.v(x).view(b, t, self.h, self.dk).transpose(1, 2)
        mixed = (self.drop(probs) @ v).transpose(1, 2).reshape(b, t, d)
        out = self.o(mixed)
        return (out, probs, mixed) if return_trace else out


class Block(nn.Module):
    def __init__(self, cfg: SeqRecConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ff1 = nn.Linear(cfg.d_model, cfg.ffn_mult * cfg.d_model)
        self.ff2 = nn.Linear(cfg.ffn_mult * cfg.d_model, cfg.d_model)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(cfg.dropout)

    def forward(
        self,
        x: torch.Tensor,
        key_mask: torch.Tensor,
        score_correction: ScoreCorrection | None = None,
        return_trace: bool = False,
    ):
        """Pre-norm attention and feed-forward, each with a residual. ``score_correction`` goes to
        the attention; with ``return_trace``: ``(output, BlockTrace)``."""
        h = self.ln1(x)
        a = self.attn(h, key_mask, score_correction, return_trace)
        if return_trace:
            a, probs, mixed = a
        mid = x + self.drop(a)
        g = self.ln2(mid)
        pre = self.ff1(g)
        act = self.act(pre)
        out = mid + self.drop(self.ff2(self.drop(act)))
        return (out, BlockTrace(h, probs, mixed, mid, g, pre, act)) if return_trace else out


class SeqRecTransformer(nn.Module):
    """Next-item prediction: ``model(input_ids)`` → logits (B, T, num_items + 1); id 0 is padding.

    With ``config.reattention`` it carries a :class:`~dpzoo.seqrec.reattention.ReAttention` state
    (DPFormer); it then implements :class:`dpzoo.privacy.protocols.NoiseAware`."""

    def __init__(self, cfg: SeqRecConfig):
        super().__init__()
        self.config = cfg
        self.item_emb = nn.Embedding(cfg.num_items + 1, cfg.d_model, padding_idx=0)
        self.pos_emb = nn.Embedding(cfg.max_len, cfg.d_model)
        self.emb_drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_blocks))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.num_items + 1)
        if cfg.tied:
            self.out.weight = self.item_emb.weight  # one tensor, two uses
        self.reattention = ReAttention(cfg.num_items, cfg.max_len) if cfg.reattention else None
        nn.init.normal_(self.item_emb.weight, std=0.02)
        # Positions at std 0.02 (items enter at 0.02·√d ≈ 0.16 for d = 64): nn.Embedding's default
        # N(0, 1) drowns the items and slows early training several-fold (measured on ML-1M).
        nn.init.normal_(self.pos_emb.weight, std=0.02)
        nn.init.zeros_(self.out.bias)

    def set_dp_noise(self, *, noise_multiplier: float, max_grad_norm: float, expected_batch_size: float) -> None:
        """The noise the optimizer adds (σ_dp, R and the expected batch B), for Re-Attention; the
        privacy engine calls it (and its ReAttention's, which is the same) when making the model
        private. Without Re-Attention: nothing to do."""
        if self.reattention is not None:
            self.reattention.set_dp_noise(
                noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, expected_batch_size=expected_batch_size
            )

    def set_token_frequencies(self, train_inputs: torch.Tensor) -> None:
        if self.reattention is not None:
            self.reattention.set_frequencies(train_inputs)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.features(input_ids))

    def features(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Final hidden states (B, T, d) before the output layer (evaluation scores only the last)."""
        b, t = input_ids.shape
        if t > self.config.max_len:
            raise InvalidArgumentError(
                f"sequence length {t} > max_len {self.config.max_len}; keep the last "
                "max_len items of each sequence or build the model with a larger max_len."
            )
        positions = torch.arange(t, device=input_ids.device).unsqueeze(0).expand(b, t)  # per sample
        scale = math.sqrt(self.config.d_model)
        x = self.emb_drop(self.item_emb(input_ids) * scale + self.pos_emb(positions))
        key_mask = input_ids != 0
        if self.reattention is None or not self.reattention.active:
            for block in self.blocks:
                x = block(x, key_mask)
        else:  # the same blocks, each wrapped: the score correction in, the variance carried beside
            var = self.reattention.input_variance(input_ids, self.config.d_model, scale)
            var_w = self.reattention.weight_variance
            for block in self.blocks:
                x, var = ReAttentionBlock(block)(x, key_mask, var, var_w)
        return self.ln_f(x)


class SeqRecRNN(nn.Module):
    """GRU / LSTM baseline for next-item prediction (DPFormer paper Table 1), DP-ready.

    Item embedding (tied to the output layer, like the vanilla Transformer), one recurrent
    layer of width d_model (:class:`dpzoo.nn.DPGRU` / :class:`~dpzoo.nn.DPLSTM`), LayerNorm
    and a full softmax over all items."""

    def __init__(self, cfg: SeqRecConfig, cell: str):
        super().__init__()
        self.config, self.cell = cfg, cell
        self.item_emb = nn.Embedding(cfg.num_items + 1, cfg.d_model, padding_idx=0)
        self.rnn = (DPGRU if cell == "gru" else DPLSTM)(cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.num_items + 1)
        if cfg.tied:
            self.out.weight = self.item_emb.weight
        nn.init.normal_(self.item_emb.weight, std=0.02)
        nn.init.zeros_(self.out.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.features(input_ids))

    def features(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.config.max_len:
            raise InvalidArgumentError(
                f"sequence length {input_ids.shape[1]} > max_len {self.config.max_len}; keep the "
                "last max_len items of each sequence or build the model with a larger max_len."
            )
        h, _ = self.rnn(self.drop(self.item_emb(input_ids)))
        return self.ln_f(self.drop(h))
