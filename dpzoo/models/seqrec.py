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
from ..seqrec import error_propagation as ep
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
    reattention: bool = False  # DPFormer's Re-Attention (§5.2); no trainable parameters

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

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor, var: torch.Tensor | None = None,
                var_w: float = 0.0):
        """Without ``var``: the attention output. With ``var`` (B, T), the per-coordinate variance of
        ``x`` from DP noise: Re-Attention (§5.2) corrects the logits by the keys' variance, and
        ``(output, output variance)`` is returned."""
        b, t, d = x.shape
        s, q = self.scores(x)
        if var is not None:
            with torch.no_grad():  # a debiasing constant, not a learned path (no gradient)
                var_k = ep.iso_linear(x, var, self.k.weight, var_w, var_w)
                correction = ep.score_correction(q.detach(), var_k, 1 / math.sqrt(self.dk))
            s = s - correction  # outside no_grad: the scores must stay in the graph (q and k train)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        allowed = causal & key_mask[:, None, None, :]
        s = s.masked_fill(~allowed, -1e9)  # finite: rows of padding stay finite (their loss is ignored)
        probs = torch.softmax(s, dim=-1)
        v = self.v(x).view(b, t, self.h, self.dk).transpose(1, 2)
        mixed = (self.drop(probs) @ v).transpose(1, 2).reshape(b, t, d)
        out = self.o(mixed)
        if var is None:
            return out
        with torch.no_grad():
            var_v = ep.iso_linear(x, var, self.v.weight, var_w, var_w)
            var_mixed = ep.iso_attention_values(probs, var_v)
            return out, ep.iso_linear(mixed, var_mixed, self.o.weight, var_w, var_w)


class Block(nn.Module):
    def __init__(self, cfg: SeqRecConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ff1 = nn.Linear(cfg.d_model, cfg.ffn_mult * cfg.d_model)
        self.ff2 = nn.Linear(cfg.ffn_mult * cfg.d_model, cfg.d_model)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, key_mask, var: torch.Tensor | None = None, var_w: float = 0.0):
        if var is None:
            x = x + self.drop(self.attn(self.ln1(x), key_mask))
            return x + self.drop(self.ff2(self.drop(self.act(self.ff1(self.ln2(x))))))
        # Re-Attention: the same computation with the noise variance carried beside it (§5.2.2).
        h = self.ln1(x)
        with torch.no_grad():
            var_h = ep.iso_layer_norm(x, var, self.ln1.weight, self.ln1.eps, var_w, var_w)
        a, var_a = self.attn(h, key_mask, var_h, var_w)
        x = x + self.drop(a)
        var = ep.iso_residual(var, var_a)
        h = self.ln2(x)
        pre = self.ff1(h)
        act = self.act(pre)
        out = x + self.drop(self.ff2(self.drop(act)))
        with torch.no_grad():
            var_h = ep.iso_layer_norm(x, var, self.ln2.weight, self.ln2.eps, var_w, var_w)
            var_pre = ep.iso_linear(h, var_h, self.ff1.weight, var_w, var_w)
            var_act = ep.iso_relu(pre, var_pre)
            var = ep.iso_residual(var, ep.iso_linear(act, var_act, self.ff2.weight, var_w, var_w))
        return out, var


class ReAttention(nn.Module):
    """Effective-error state of DPFormer's Re-Attention (§5.2.1, Def. 5.1, Claims 5.3–5.4).

    No trainable parameters: three buffers. ``noise_std`` is σ_dp·R / B, the standard deviation
    of the DP noise on the averaged gradient (R the clipping norm, B the expected batch size);
    the privacy engine sets it (:meth:`set_dp_noise`) when the model is made private, so a
    model that is not (or not yet) private computes exactly the vanilla Transformer.
    ``item_freq[i]`` is p_i, the probability that a training sequence contains item i, and
    ``pos_freq[t]`` the probability that position t holds a real item (positional embedding t
    is only trained by those sequences: the same Def. 5.1 relevance indicator). The effective
    error of item i's embedding is noise_std / p_i (Claim 5.4), of position t's noise_std /
    pos_freq[t], and of every block weight noise_std (Claim 5.3).
    """

    def __init__(self, num_items: int, max_len: int):
        super().__init__()
        self.register_buffer("noise_std", torch.zeros(()))
        self.register_buffer("item_freq", torch.ones(num_items + 1))
        self.register_buffer("pos_freq", torch.ones(max_len))

    def set_dp_noise(self, *, noise_multiplier: float, max_grad_norm: float, expected_batch_size: float) -> None:
        if expected_batch_size <= 0:
            raise ValueError(f"expected_batch_size must be > 0, got {expected_batch_size}")
        self.noise_std.fill_(float(noise_multiplier) * float(max_grad_norm) / float(expected_batch_size))

    @torch.no_grad()
    def set_frequencies(self, train_inputs: torch.Tensor) -> None:
        """p_i and the position frequencies from the training inputs (N, T), left-padded with 0.

        The paper assumes these frequencies public (Remark C.1); computed from private data they
        are not covered by the DP guarantee of training (see docs/DESIGN.md)."""
        n, t = train_inputs.shape
        if t > self.pos_freq.numel():
            raise ValueError(f"inputs are {t} long, the model's max_len is {self.pos_freq.numel()}")
        if n == 0:
            raise ValueError("no training inputs to count item frequencies from")
        ids = train_inputs.long().to(self.item_freq.device)
        rows = torch.arange(n, device=ids.device).unsqueeze(1).expand_as(ids)
        seen = torch.zeros(n, self.item_freq.numel(), dtype=torch.bool, device=ids.device)
        seen[rows.reshape(-1), ids.reshape(-1)] = True  # each sequence counts an item once
        freq = seen[:, 1:].sum(0).double() / n
        self.item_freq[1:] = freq.clamp_min(1.0 / n).to(self.item_freq)  # never seen: as if once
        pos = (ids != 0).sum(0).double() / n
        self.pos_freq.fill_(1.0)
        self.pos_freq[:t] = pos.clamp_min(1.0 / n).to(self.pos_freq)

    @torch.no_grad()
    def input_variance(self, input_ids: torch.Tensor, d_model: int, emb_scale: float) -> torch.Tensor:
        """(B, T) per-coordinate variance of item_emb·emb_scale + pos_emb; 0 at padding."""
        s = self.noise_std
        t = input_ids.shape[1]
        var = (emb_scale * s / self.item_freq[input_ids]).pow(2) + (s / self.pos_freq[:t]).pow(2)
        return var.masked_fill(input_ids == 0, 0.0)


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
        self.reattention = ReAttention(cfg.num_items, cfg.max_len) if cfg.reattention else None
        nn.init.normal_(self.item_emb.weight, std=0.02)
        nn.init.zeros_(self.out.bias)

    def set_dp_noise(self, **kw) -> None:
        """Called by the privacy engine with the noise it adds (Re-Attention's σ_dp and B)."""
        if self.reattention is not None:
            self.reattention.set_dp_noise(**kw)

    def set_token_frequencies(self, train_inputs: torch.Tensor) -> None:
        if self.reattention is not None:
            self.reattention.set_frequencies(train_inputs)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.features(input_ids))

    def features(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Final hidden states (B, T, d) before the output layer (evaluation scores only the last)."""
        b, t = input_ids.shape
        if t > self.config.max_len:
            raise ValueError(f"sequence length {t} > max_len {self.config.max_len}")
        positions = torch.arange(t, device=input_ids.device).unsqueeze(0).expand(b, t)  # per sample
        scale = math.sqrt(self.config.d_model)
        x = self.emb_drop(self.item_emb(input_ids) * scale + self.pos_emb(positions))
        key_mask = input_ids != 0
        if self.reattention is None or float(self.reattention.noise_std) == 0.0:
            for block in self.blocks:
                x = block(x, key_mask)
        else:
            var = self.reattention.input_variance(input_ids, self.config.d_model, scale)
            var_w = float(self.reattention.noise_std) ** 2
            for block in self.blocks:
                x, var = block(x, key_mask, var, var_w)
        return self.ln_f(x)


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
        return self.out(self.features(input_ids))

    def features(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.config.max_len:
            raise ValueError(f"sequence length {input_ids.shape[1]} > max_len {self.config.max_len}")
        h, _ = self.rnn(self.drop(self.item_emb(input_ids)))
        return self.ln_f(self.drop(h))


_OVERRIDES = {
    "num_items": "items (output classes = num_items + 1; id 0 is padding)",
    "max_len": "longest input sequence (positional embeddings)", "d_model": "model width (default 64)",
    "num_heads": "attention heads (default 1)", "num_blocks": "Transformer blocks (default 2)",
    "ffn_mult": "feed-forward width / d_model (default 1)", "dropout": "dropout (default 0.2)",
    **PATCH_OPTIONS,
}
_TEST = {"num_items": 50, "max_len": 16, "d_model": 16, "num_heads": 2, "num_blocks": 2, "dropout": 0.0}


def _card(name: str, tied: bool, reattention: bool = False) -> ModelCard:
    if reattention:
        return ModelCard(
            name=name,
            summary=("DPFormer: the tied causal Transformer for next-item prediction with Re-Attention, which "
                     "debiases attention scores by the DP noise each key carries (long-tailed items are noisier)."),
            architecture=("dpzoo `SeqRecTransformer(reattention=True)`: d=64, 1 head, 2 pre-norm blocks, learned "
                          "positions, tied full softmax, plus a parameter-free `ReAttention` state"),
            library="dpzoo", task="sequential-recommendation",
            patches=("written DP-ready: LayerNorm, biases on every Linear, no in-place ops, per-sample position ids",
                     "tied: `item_emb.weight` = `out.weight` (exact per-sample norms by Phantom Clipping)",
                     "Re-Attention: logits minus C·σ_k²/2 with σ_k² propagated from the effective errors "
                     "(σ_dp·R/B per block weight, ÷ p_i per item embedding); no trainable parameters, the correction a "
                     "constant (no gradient through it; the scores themselves train q and k)"),
            weight_source="random initialisation (train with `dpzoo train dpformer`)",
            license="Apache-2.0",
            papers=("DPFormer: Learning Differentially Private Transformer on Long-Tailed Data: §4 (Phantom "
                    "Clipping), §5 (Re-Attention: Def. 5.1, Claims 5.3-5.4, eqs. 5.2, 5.5-5.7, App. C-D), App. E.2",),
            overrides=_OVERRIDES, test_overrides=dict(_TEST),
            example_input={"kind": "tokens", "vocab_size": _TEST["num_items"] + 1, "seq_len": _TEST["max_len"]},
            notes=("The engine sets the noise (σ_dp, R, expected batch B) when the model is made private; "
                   "`dpzoo train` sets the item and position frequencies from the training inputs. Until both "
                   "are set the model computes exactly transformer-seqrec. The frequencies are treated as "
                   "public, as the paper does (Remark C.1): see docs/DESIGN.md. MovieLens-1M runs beside the "
                   "paper's Table 1, and why its gain does not show at this project's budget: docs/RESULTS.md."),
        )
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
        notes="The same network with Re-Attention is the `dpformer` entry; GRU/LSTM baselines: `gru-seqrec`, `lstm-seqrec`.",
    )


def _build(name: str, tied: bool, overrides: dict, reattention: bool = False) -> nn.Module:
    arch, patch = split_patch_options(overrides)
    reject_unknown(name, arch, _OVERRIDES)
    cfg = SeqRecConfig(**{**arch, "tied": tied, "reattention": reattention})
    return make_dp_ready(SeqRecTransformer(cfg), groupnorm=False, **patch)


def _entry(name: str, tied: bool, reattention: bool = False):
    @register_model(name, card=_card(name, tied, reattention))
    def build(pretrained: bool = False, pretrained_tag: str | None = None, weights=None, **overrides):
        if pretrained:
            from ..errors import CheckpointError
            raise CheckpointError(f"{name} has no pretrained weights; train it with `dpzoo train {name}`.")
        model = _build(name, tied, overrides, reattention)
        if weights is not None:
            from ..checkpoint import load_state_dict_checked, read_state_dict
            load_state_dict_checked(model, read_state_dict(weights), source=f"checkpoint {weights}")
        return model
    build.__name__ = name.replace("-", "_")
    return build


transformer_seqrec = _entry("transformer-seqrec", True)
transformer_seqrec_untied = _entry("transformer-seqrec-untied", False)
dpformer = _entry("dpformer", True, reattention=True)


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
