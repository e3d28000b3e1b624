"""Transformers for next-item prediction (DPFormer paper §5, App. E.2), DP-ready.

A causal Transformer encoder over a user's item sequence (left-padded with 0): learned
positional embedding, ``num_blocks`` pre-norm blocks of single- or multi-head attention and a
feed-forward layer, and a full softmax over all items. With ``tied=True`` the output layer
reuses the input item embedding (one tensor, two uses: dpzoo's hooks give its exact
per-sample norm, Phantom Clipping). Attention is written with plain ``nn.Linear``
projections and an explicit softmax so every parameter has a per-sample rule and the
Re-Attention correction (issue 5) can act on the scores.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..registry import ModelCard, register_model
from ..surgery import make_dp_ready
from ._common import PATCH_OPTIONS, reject_unknown, split_patch_options


@dataclass
class SeqRecConfig:
    num_items: int = 3416  # MovieLens-1M after SASRec preprocessing
    max_len: int = 200
    d_model: int = 64
    num_heads: int = 1
    num_blocks: int = 2
    ffn_mult: int = 1  # feed-forward width = ffn_mult * d_model (SASRec's point-wise FFN)
    dropout: float = 0.2
    tied: bool = True

    def to_dict(self) -> dict:
        return asdict(self)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: SeqRecConfig):
        super().__init__()
        if cfg.d_model % cfg.num_heads:
            raise ValueError(f"d_model {cfg.d_model} is not divisible by num_heads {cfg.num_heads}")
        self.h, self.dk = cfg.num_heads, cfg.d_model // cfg.num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(cfg.d_model, cfg.d_model) for _ in range(4))
        self.drop = nn.Dropout(cfg.dropout)

    def scores(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.h, self.dk).transpose(1, 2)
        k = self.k(x).view(b, t, self.h, self.dk).transpose(1, 2)
        return q @ k.transpose(-2, -1) / math.sqrt(self.dk), q

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        s, _ = self.scores(x)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        allowed = causal & key_mask[:, None, None, :]
        s = s.masked_fill(~allowed, -1e9)  # finite: rows of padding stay finite (their loss is ignored)
        attn = self.drop(torch.softmax(s, dim=-1))
        v = self.v(x).view(b, t, self.h, self.dk).transpose(1, 2)
        return self.o((attn @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: SeqRecConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ff1 = nn.Linear(cfg.d_model, cfg.ffn_mult * cfg.d_model)
        self.ff2 = nn.Linear(cfg.ffn_mult * cfg.d_model, cfg.d_model)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, key_mask):
        x = x + self.drop(self.attn(self.ln1(x), key_mask))
        return x + self.drop(self.ff2(self.drop(self.act(self.ff1(self.ln2(x))))))


class SeqRecTransformer(nn.Module):
    """Next-item prediction: ``model(input_ids)`` → logits (B, T, num_items + 1); id 0 is padding."""

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
        nn.init.normal_(self.item_emb.weight, std=0.02)
        nn.init.zeros_(self.out.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        b, t = input_ids.shape
        if t > self.config.max_len:
            raise ValueError(f"sequence length {t} > max_len {self.config.max_len}")
        positions = torch.arange(t, device=input_ids.device).unsqueeze(0).expand(b, t)  # per sample
        x = self.emb_drop(self.item_emb(input_ids) * math.sqrt(self.config.d_model) + self.pos_emb(positions))
        key_mask = input_ids != 0
        for block in self.blocks:
            x = block(x, key_mask)
        return self.out(self.ln_f(x))


class SeqRecRNN(nn.Module):
    """GRU / LSTM baseline for next-item prediction (DPFormer paper Table 1), DP-ready.

    Item embedding (tied to the output layer, like the vanilla Transformer), one recurrent
    layer of width d_model (:class:`dpzoo.nn.DPGRU` / :class:`~dpzoo.nn.DPLSTM`), LayerNorm
    and a full softmax over all items."""

    def __init__(self, cfg: SeqRecConfig, cell: str):
        super().__init__()
        from ..nn.recurrent import DPGRU, DPLSTM
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
        if input_ids.shape[1] > self.config.max_len:
            raise ValueError(f"sequence length {input_ids.shape[1]} > max_len {self.config.max_len}")
        h, _ = self.rnn(self.drop(self.item_emb(input_ids)))
        return self.out(self.ln_f(self.drop(h)))


_OVERRIDES = {
    "num_items": "items (output classes = num_items + 1; id 0 is padding)",
    "max_len": "longest input sequence (positional embeddings)", "d_model": "model width (default 64)",
    "num_heads": "attention heads (default 1)", "num_blocks": "Transformer blocks (default 2)",
    "ffn_mult": "feed-forward width / d_model (default 1)", "dropout": "dropout (default 0.2)",
    **PATCH_OPTIONS,
}
_TEST = {"num_items": 50, "max_len": 16, "d_model": 16, "num_heads": 2, "num_blocks": 2, "dropout": 0.0}


def _card(name: str, tied: bool) -> ModelCard:
    return ModelCard(
        name=name,
        summary=("Causal Transformer for next-item prediction with the item embedding tied to the output layer "
                 "(the vanilla DP Transformer of the DPFormer paper)." if tied else
                 "Causal Transformer for next-item prediction with separate input and output item embeddings "
                 "(the paper's 'without parameter sharing' baseline)."),
        architecture="dpzoo `SeqRecTransformer`: d=64, 1 head, 2 pre-norm blocks, learned positions, full softmax",
        library="dpzoo", task="sequential-recommendation",
        patches=("written DP-ready: LayerNorm, biases on every Linear, no in-place ops, per-sample position ids",
                 "tied: `item_emb.weight` = `out.weight` (exact per-sample norms by Phantom Clipping)" if tied
                 else "untied: separate output layer"),
        weight_source="random initialisation (train with `dpzoo train`)",
        license="Apache-2.0",
        papers=("DPFormer: Learning Differentially Private Transformer on Long-Tailed Data: §4 (Phantom Clipping), "
                "§6 and App. E.2 (setting)", "Kang & McAuley, Self-Attentive Sequential Recommendation (SASRec), ICDM 2018"),
        overrides=_OVERRIDES, test_overrides=dict(_TEST),
        example_input={"kind": "tokens", "vocab_size": _TEST["num_items"] + 1, "seq_len": _TEST["max_len"]},
        notes="Re-Attention (the `dpformer` entry) and GRU/LSTM baselines are being built (issue 5).",
    )


def _build(name: str, tied: bool, overrides: dict) -> nn.Module:
    arch, patch = split_patch_options(overrides)
    reject_unknown(name, arch, _OVERRIDES)
    cfg = SeqRecConfig(**{**arch, "tied": tied})
    return make_dp_ready(SeqRecTransformer(cfg), groupnorm=False, **patch)


def _entry(name: str, tied: bool):
    @register_model(name, card=_card(name, tied))
    def build(pretrained: bool = False, pretrained_tag: str | None = None, weights=None, **overrides):
        if pretrained:
            from ..errors import CheckpointError
            raise CheckpointError(f"{name} has no pretrained weights; train it with `dpzoo train {name}`.")
        model = _build(name, tied, overrides)
        if weights is not None:
            from ..checkpoint import load_state_dict_checked, read_state_dict
            load_state_dict_checked(model, read_state_dict(weights), source=f"checkpoint {weights}")
        return model
    build.__name__ = name.replace("-", "_")
    return build


transformer_seqrec = _entry("transformer-seqrec", True)
transformer_seqrec_untied = _entry("transformer-seqrec-untied", False)


def _rnn_entry(name: str, cell: str):
    card = ModelCard(
        name=name,
        summary=f"{cell.upper()} baseline for next-item prediction (item embedding tied to the output layer), DP-ready.",
        architecture=f"dpzoo `SeqRecRNN`: item embedding d=64, one dpzoo.nn.DP{cell.upper()} layer, full softmax",
        library="dpzoo", task="sequential-recommendation",
        patches=(f"DP{cell.upper()} built from nn.Linear (torch's fused {cell.upper()} has no per-sample rule); same "
                 "equations and gate order as torch", "tied: `item_emb.weight` = `out.weight`"),
        weight_source="random initialisation (train with `dpzoo train`)", license="Apache-2.0",
        papers=("DPFormer: Learning Differentially Private Transformer on Long-Tailed Data: Table 1 baselines",),
        overrides={k: v for k, v in _OVERRIDES.items() if k not in ("num_heads", "num_blocks", "ffn_mult")},
        test_overrides={"num_items": 50, "max_len": 8, "d_model": 8, "dropout": 0.0},
        example_input={"kind": "tokens", "vocab_size": 51, "seq_len": 8},
    )

    @register_model(name, card=card)
    def build(pretrained: bool = False, pretrained_tag: str | None = None, weights=None, **overrides):
        if pretrained:
            from ..errors import CheckpointError
            raise CheckpointError(f"{name} has no pretrained weights; train it with `dpzoo train {name}`.")
        arch, patch = split_patch_options(overrides)
        reject_unknown(name, arch, card.overrides)
        model = make_dp_ready(SeqRecRNN(SeqRecConfig(**arch), cell), groupnorm=False, **patch)
        if weights is not None:
            from ..checkpoint import load_state_dict_checked, read_state_dict
            load_state_dict_checked(model, read_state_dict(weights), source=f"checkpoint {weights}")
        return model
    build.__name__ = name.replace("-", "_")
    return build


gru_seqrec = _rnn_entry("gru-seqrec", "gru")
lstm_seqrec = _rnn_entry("lstm-seqrec", "lstm")
