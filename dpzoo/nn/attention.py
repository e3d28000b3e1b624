"""Multi-head attention built from ``nn.Linear``: ``torch.nn.MultiheadAttention``'s function with
parameters per-sample rules can see (:class:`DPMultiheadAttention`).

``nn.MultiheadAttention`` keeps q/k/v in one packed ``in_proj_weight`` and hands it, and
``out_proj``'s parameters, to ``F.multi_head_attention_forward``: no layer is ever called, so no
per-sample rule sees them (Opacus replaces it with its own ``DPMultiheadAttention`` for the same
reason). Here q, k, v and the output are four ``nn.Linear`` calls and ``add_bias_kv``'s vectors a
:class:`SequenceBias`, all on batch-first tensors: with ``batch_first=False`` the inputs are
transposed once, on entry, so every layer sees the batch in dim 0 (dpzoo's hooks need that).
The attention itself mirrors torch's arithmetic: q scaled by 1/√d_head before q·kᵀ, masks
(bool: −inf where True; float: added) merged, softmax, dropout; ``need_weights=False`` goes
through ``F.scaled_dot_product_attention`` as torch does (so ``is_causal`` has torch's meaning).
:meth:`DPMultiheadAttention.from_torch` copies a module; ``load_state_dict`` accepts torch's keys.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InvalidArgumentError

__all__ = ["DPMultiheadAttention", "SequenceBias", "mha_state_dict_to_dp"]


class SequenceBias(nn.Module):
    """Appends one learned vector to every sample's sequence: (B, S, E) → (B, S + 1, E)
    (``nn.MultiheadAttention``'s ``bias_k`` / ``bias_v``)."""

    def __init__(self, embed_dim: int, device=None, dtype=None):
        super().__init__()
        self.bias = nn.Parameter(torch.empty(embed_dim, device=device, dtype=dtype))
        nn.init.normal_(self.bias, std=math.sqrt(1.0 / embed_dim))  # xavier_normal_ of torch's (1, 1, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, self.bias.expand(x.shape[0], 1, -1)], 1)


def mha_state_dict_to_dp(state_dict: dict, prefix: str = "") -> dict:
    """Rename ``nn.MultiheadAttention`` keys under ``prefix`` to :class:`DPMultiheadAttention`'s, in
    place: ``in_proj_weight`` / ``in_proj_bias`` split into q, k, v; ``{q,k,v}_proj_weight``;
    ``bias_k`` / ``bias_v``. ``out_proj.*`` keeps its name. Returns ``state_dict``."""
    packed = state_dict.pop(prefix + "in_proj_weight", None)
    if packed is not None:
        for name, w in zip("qkv", packed.chunk(3, 0)):
            state_dict[f"{prefix}{name}_proj.weight"] = w
    for name in "qkv":
        w = state_dict.pop(f"{prefix}{name}_proj_weight", None)
        if w is not None:
            state_dict[f"{prefix}{name}_proj.weight"] = w
    bias = state_dict.pop(prefix + "in_proj_bias", None)
    if bias is not None:
        for name, b in zip("qkv", bias.chunk(3, 0)):
            state_dict[f"{prefix}{name}_proj.bias"] = b
    for name in ("bias_k", "bias_v"):
        b = state_dict.get(prefix + name)
        if isinstance(b, torch.Tensor):
            state_dict[f"{prefix}{name}.bias"] = state_dict.pop(prefix + name).reshape(-1)
    return state_dict


def _float_mask(mask: torch.Tensor | None, like: torch.Tensor, name: str) -> torch.Tensor | None:
    """torch's canonical mask: bool → 0 / −inf (True = not attended), float kept."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros_like(mask, dtype=like.dtype).masked_fill_(mask, float("-inf"))
    if not torch.is_floating_point(mask):
        raise InvalidArgumentError(f"{name} must be a bool or floating-point tensor, got {mask.dtype}.")
    return mask


class DPMultiheadAttention(nn.Module):
    """Drop-in for ``nn.MultiheadAttention`` (same arguments, same ``forward``), with ``q_proj``,
    ``k_proj``, ``v_proj``, ``out_proj`` (``nn.Linear``) and, with ``add_bias_kv``, ``bias_k`` /
    ``bias_v`` (:class:`SequenceBias`)."""

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0 or embed_dim % num_heads:
            raise InvalidArgumentError(
                f"embed_dim ({embed_dim}) must be a positive multiple of num_heads ({num_heads})."
            )
        f = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self.dropout, self.batch_first, self.add_zero_attn = float(dropout), batch_first, add_zero_attn
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **f)
        self.k_proj = nn.Linear(self.kdim, embed_dim, bias=bias, **f)
        self.v_proj = nn.Linear(self.vdim, embed_dim, bias=bias, **f)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **f)
        self.bias_k = SequenceBias(embed_dim, **f) if add_bias_kv else None
        self.bias_v = SequenceBias(embed_dim, **f) if add_bias_kv else None
        # what torch's Transformer layers read to choose their fused fast path (never taken here)
        self.in_proj_weight = None
        self.in_proj_bias = None
        self._qkv_same_embed_dim = False
        self.register_load_state_dict_pre_hook(self._torch_keys)

    @staticmethod
    def _torch_keys(module, state_dict, prefix, *args) -> None:
        mha_state_dict_to_dp(state_dict, prefix)

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention) -> "DPMultiheadAttention":
        """A :class:`DPMultiheadAttention` computing what ``mha`` computes: its options, weights
        (split from ``in_proj_weight``), device, dtype, ``requires_grad`` flags and mode."""
        if not isinstance(mha, nn.MultiheadAttention):
            raise InvalidArgumentError(f"from_torch copies an nn.MultiheadAttention, not {type(mha).__name__}.")
        like = mha.out_proj.weight
        new = cls(
            mha.embed_dim,
            mha.num_heads,
            dropout=mha.dropout,
            add_bias_kv=mha.bias_k is not None,
            add_zero_attn=mha.add_zero_attn,
            kdim=mha.kdim,
            vdim=mha.vdim,
            batch_first=mha.batch_first,
            device=like.device,
            dtype=like.dtype,
        )
        # bias=False in torch drops in_proj_bias and out_proj.bias; BiTFiT-Add may restore either
        for name in ("q_proj", "k_proj", "v_proj"):
            if mha.in_proj_bias is None:
                getattr(new, name).bias = None
        if mha.out_proj.bias is None:
            new.out_proj.bias = None
        state = mha_state_dict_to_dp(dict(mha.state_dict()))
        new.load_state_dict(state)
        grads = dict(mha.named_parameters())
        for name, p in new.named_parameters():
            src = _source_name(name, packed=mha.in_proj_weight is not None)
            if src in grads:
                p.requires_grad_(grads[src].requires_grad)
        return new.train(mha.training)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batched = query.dim() == 3
        if batched and not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        elif not batched:
            query, key, value = (t.unsqueeze(0) for t in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        if is_causal and attn_mask is None:
            raise InvalidArgumentError(
                "is_causal=True is a hint that attn_mask is the causal mask, as in torch: pass attn_mask too "
                "(nn.Transformer.generate_square_subsequent_mask)."
            )
        b, tgt = query.shape[:2]
        q, k, v = self.q_proj(query), self.k_proj(key), self.v_proj(value)
        kpm = _float_mask(key_padding_mask, q, "key_padding_mask")
        causal = is_causal and kpm is None and not need_weights  # torch then ignores attn_mask's values
        mask = None if causal else _float_mask(attn_mask, q, "attn_mask")
        shapes = ((tgt, key.shape[1]), (b * self.num_heads, tgt, key.shape[1]))
        if mask is not None and tuple(mask.shape) not in shapes:
            raise InvalidArgumentError(
                f"attn_mask of shape {tuple(mask.shape)} does not fit: it must be {shapes[0]} or {shapes[1]} "
                "(target length, source length; batch · heads first for a 3-d mask)."
            )
        if self.bias_k is not None and self.bias_v is not None:
            k, v = self.bias_k(k), self.bias_v(v)
            mask = F.pad(mask, (0, 1)) if mask is not None else None
            kpm = F.pad(kpm, (0, 1)) if kpm is not None else None
        h, d = self.num_heads, self.head_dim
        q, k, v = (t.reshape(b, t.shape[1], h, d).transpose(1, 2) for t in (q, k, v))  # (B, H, T, d)
        if self.add_zero_attn:
            k, v = (torch.cat([t, t.new_zeros(b, h, 1, d)], 2) for t in (k, v))
            mask = F.pad(mask, (0, 1)) if mask is not None else None
            kpm = F.pad(kpm, (0, 1)) if kpm is not None else None
        src = k.shape[2]
        if mask is not None:  # (L, S) or (B·H, L, S) [(H, L, S) unbatched] -> broadcastable to (B, H, L, S)
            mask = mask.reshape(1, 1, tgt, src) if mask.dim() == 2 else mask.reshape(b, h, tgt, src)
        if kpm is not None:
            kpm = kpm.reshape(b, 1, 1, src)
            mask = kpm if mask is None else mask + kpm
        p = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            scores = torch.matmul(q * math.sqrt(1.0 / float(d)), k.transpose(-2, -1))
            if mask is not None:
                scores = scores + mask
            weights = torch.softmax(scores, dim=-1)
            if p > 0.0:
                weights = F.dropout(weights, p=p)
            out = torch.matmul(weights, v)
            if average_attn_weights:
                weights = weights.mean(dim=1)
        else:
            out = F.scaled_dot_product_attention(q, k, v, mask, p, is_causal=causal)
        out = self.out_proj(out.transpose(1, 2).reshape(b, tgt, self.embed_dim))
        if not batched:
            return out.squeeze(0), (weights.squeeze(0) if weights is not None else None)
        if not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}, "
            f"batch_first={self.batch_first}, add_zero_attn={self.add_zero_attn}"
        )


def _source_name(name: str, packed: bool) -> str:
    """The ``nn.MultiheadAttention`` parameter a :class:`DPMultiheadAttention` parameter comes from
    (``packed``: q, k, v in one ``in_proj_weight``; else ``{q,k,v}_proj_weight``)."""
    if name.startswith(("q_proj.", "k_proj.", "v_proj.")):
        if name.endswith("bias"):
            return "in_proj_bias"
        return "in_proj_weight" if packed else f"{name[0]}_proj_weight"
    if name.startswith(("bias_k.", "bias_v.")):
        return name.split(".")[0]
    return name
