"""Re-Attention (DPFormer paper §5.2, App. C-D): its state, the variance propagation and the
score correction, applied to a Transformer block by wrapping it.

* :class:`ReAttention`: the effective-error state (Def. 5.1, Claims 5.3-5.4), three buffers and
  no trainable parameters. It is :class:`dpzoo.privacy.protocols.NoiseAware`: the privacy
  engine tells it the DP noise when the model is made private.
* Variance propagation, one scalar variance per token (§5.2.2: "the effective error can be
  represented in scalar"). Each activation is treated as independent Gaussian per coordinate;
  the DP noise on a weight matrix is isotropic with variance ``var_w`` (its effective error
  squared). The *means* are the activations the network actually computes with its noisy
  parameters ("the noisy parameter can serve as an estimate of its mean", §5.2.2), so only one
  scalar per token travels beside the forward pass: O(B·T·d). :func:`iso_linear` is eq. 5.5
  (Lemma D.1) averaged over the outputs; :func:`relu` the exact moments of max(X, 0)
  (Lemma D.2 with X₂ ≡ 0; eq. 5.6 as printed subtracts c², the squared *input* mean, where the
  variance subtracts E[ReLU(X)]², see docs/DESIGN.md); LayerNorm, attention values and
  residuals are dpzoo's choices where the paper leaves them open.
* :func:`score_correction`: the log-space form of S_i ← S_i / exp(C·σ_i²/2), renormalised (§5.2).
* :class:`ReAttentionBlock`: runs a :class:`~dpzoo.seqrec.modeling.Block`'s own forward once,
  with the correction subtracted from its attention logits, and propagates the variance from
  the intermediates that forward returns (no second copy of the block's computation).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import InvalidArgumentError
from .item_prior import user_item_sets

__all__ = [
    "ReAttention",
    "ReAttentionBlock",
    "key_noise_correction",
    "score_correction",
    "relu",
    "iso_linear",
    "iso_layer_norm",
    "iso_relu",
    "iso_attention_values",
    "iso_residual",
]

_SQRT2 = math.sqrt(2.0)


# --------------------------------------------------------------------------------- state


class ReAttention(nn.Module):
    """Effective-error state of DPFormer's Re-Attention (§5.2.1, Def. 5.1, Claims 5.3–5.4).

    No trainable parameters: three buffers. ``noise_std`` is σ_dp·R / B, the standard deviation
    of the DP noise on the averaged gradient (R the clipping norm, B the expected batch size);
    the privacy engine sets it (:meth:`set_dp_noise`, the :class:`~dpzoo.privacy.protocols.NoiseAware`
    protocol) when the model is made private, so a model that is not (or not yet) private
    computes exactly the vanilla Transformer.
    ``item_freq[i]`` is p_i, the probability that a training sequence contains item i, and
    ``pos_freq[t]`` the probability that position t holds a real item (positional embedding t
    is only trained by those sequences: the same Def. 5.1 relevance indicator). The effective
    error of item i's embedding is noise_std / p_i (Claim 5.4), of position t's noise_std /
    pos_freq[t], and of every block weight noise_std (Claim 5.3).
    """

    noise_std: torch.Tensor  # the three buffers registered in __init__
    item_freq: torch.Tensor
    pos_freq: torch.Tensor

    def __init__(self, num_items: int, max_len: int):
        super().__init__()
        self.register_buffer("noise_std", torch.zeros(()))
        self.register_buffer("item_freq", torch.ones(num_items + 1))
        self.register_buffer("pos_freq", torch.ones(max_len))

    def set_dp_noise(self, *, noise_multiplier: float, max_grad_norm: float, expected_batch_size: float) -> None:
        if expected_batch_size <= 0:
            raise InvalidArgumentError(
                f"expected_batch_size={expected_batch_size} must be > 0; pass the expected "
                "(logical) batch size of DP training."
            )
        self.noise_std.fill_(float(noise_multiplier) * float(max_grad_norm) / float(expected_batch_size))

    @property
    def active(self) -> bool:
        """Whether there is noise to correct for (otherwise the model runs its plain blocks)."""
        return float(self.noise_std) != 0.0

    @property
    def weight_variance(self) -> float:
        """var_w: the variance of the noise on every block weight, (σ_dp·R/B)² (Claim 5.3)."""
        return float(self.noise_std) ** 2

    @torch.no_grad()
    def set_frequencies(self, train_inputs: torch.Tensor) -> None:
        """p_i and the position frequencies from the training inputs (N, T), left-padded with 0.

        The paper assumes these frequencies public (Remark C.1); computed from private data they
        are not covered by the DP guarantee of training (see docs/DESIGN.md)."""
        n, t = train_inputs.shape
        if t > self.pos_freq.numel():
            raise InvalidArgumentError(
                f"inputs are {t} long but the model's max_len is {self.pos_freq.numel()}; "
                "truncate the inputs to max_len."
            )
        if n == 0:
            raise InvalidArgumentError(
                "no training inputs to count item frequencies from; pass a non-empty (N, T) tensor."
            )
        ids = train_inputs.long().to(self.item_freq.device)
        held = user_item_sets(ids, self.item_freq.numel() - 1)  # each sequence counts an item once
        freq = held[:, 1:].sum(0).double() / n
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


# --------------------------------------------------------------------------- propagation


def _phi(x):
    return torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _Phi(x):
    return 0.5 * (1 + torch.erf(x / _SQRT2))


def relu(c: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact (mean, var) of ReLU(X), X ~ N(c, d)."""
    s = d.clamp_min(1e-30).sqrt()
    a = c / s
    m1 = c * _Phi(a) + s * _phi(a)
    m2 = (c * c + d) * _Phi(a) + c * s * _phi(a)
    return m1, (m2 - m1 * m1).clamp_min(0)


def iso_linear(
    x: torch.Tensor, var: torch.Tensor, weight: torch.Tensor, var_w: float = 0.0, var_b: float = 0.0
) -> torch.Tensor:
    """Per-token output variance of y = x Wᵀ + b (eq. 5.5 averaged over the outputs).

    ``x`` (…, d_in) is the realised input, ``var`` (…) its per-coordinate variance. Each output
    coordinate gets Σ_j Var[x_j] W_oj² + var_w Σ_j (Var[x_j] + E[x_j]²) + var_b; averaged over o
    the first term is var·‖W‖²_F / d_out, and Σ_j (Var[x_j] + E[x_j]²) = E‖x‖², estimated
    without bias by the realised ‖x‖².
    """
    d_out = weight.shape[0]
    return var * weight.pow(2).sum() / d_out + var_w * x.pow(2).sum(-1) + var_b


def iso_layer_norm(
    x: torch.Tensor, var: torch.Tensor, weight: torch.Tensor | None, eps: float, var_w: float = 0.0, var_b: float = 0.0
) -> torch.Tensor:
    """Per-token output variance of LayerNorm (the paper leaves LayerNorm open; dpzoo's design).

    x = m + n with n ~ N(0, var·I) over d coordinates. Centring keeps (1 - 1/d) of the noise
    variance per coordinate; the normaliser is treated as its realised value
    s² = Var_coords(x) + eps (it concentrates for large d and already contains the noise, so
    noise-dominated tokens come out with variance ≈ γ², not var·γ²/s_m²). Then
    Var[y_o] = γ_o²·var(1 - 1/d)/s² + var_w·E[x̂_o²] + var_b, averaged over o
    (E[x̂_o²] averages to Var_coords(x)/s² ≤ 1).
    """
    d = x.shape[-1]
    s2 = x.var(-1, unbiased=False) + eps
    g2 = weight.pow(2).mean() if weight is not None else 1.0
    return g2 * var * (1 - 1 / d) / s2 + var_w * (s2 - eps) / s2 + var_b


def iso_relu(pre: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """Per-token variance of ReLU(pre) with per-coordinate variance ``var`` (exact moments, averaged)."""
    return relu(pre, var.unsqueeze(-1).expand_as(pre))[1].mean(-1)


def iso_attention_values(attn: torch.Tensor, var_v: torch.Tensor) -> torch.Tensor:
    """Variance of Σ_s A_ts V_s with the attention weights held at their (corrected) values and
    independent value noise per key: Σ_s A_ts² Var[V_s]. ``attn`` (B, H, T, T), ``var_v`` (B, T)
    → (B, T), averaged over heads (the heads' outputs are concatenated coordinates)."""
    return (attn.pow(2) @ var_v[:, None, :, None]).squeeze(-1).mean(1)


def iso_residual(var_a: torch.Tensor, var_b: torch.Tensor) -> torch.Tensor:
    """x + f(x): the branch's noise treated as independent of the skip's (the covariance through
    LayerNorm and random projections is small; tests measure it against Monte-Carlo)."""
    return var_a + var_b


# ---------------------------------------------------------------------------- correction


def score_correction(q: torch.Tensor, key_var: torch.Tensor, scale: float) -> torch.Tensor:
    """Log-space Re-Attention term C·σ_k²/2 to subtract from the logits ``scale·⟨q, k⟩``.

    ⟨q, K⟩·scale with K ~ N(k, σ_k² I) has variance C·σ_k², C = scale²·⟨q, q⟩ (the paper omits
    the 1/√d factor, footnote 6). Subtracting C·σ_k²/2 before the softmax equals
    S_i / exp(C σ_i²/2) renormalised (eq. 5.2). q (B, H, T, dk), key_var (B, T) → (B, H, T, T).
    """
    c = q.pow(2).sum(-1, keepdim=True) * scale * scale
    return 0.5 * c * key_var[:, None, None, :]


def key_noise_correction(attn: nn.Module, var_in: torch.Tensor, var_w: float):
    """The score correction for a :class:`~dpzoo.seqrec.modeling.CausalSelfAttention` whose input
    has per-token variance ``var_in`` (B, T): a callable ``(x, q) → C·σ_k²/2``, σ_k² propagated
    through W_k (eq. 5.5). A debiasing constant: computed without gradient (the corrected scores
    themselves stay in the graph, so q and k train)."""

    def correction(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            var_k = iso_linear(x, var_in, attn.k.weight, var_w, var_w)
            return score_correction(q.detach(), var_k, 1 / math.sqrt(attn.dk))

    return correction


class ReAttentionBlock(nn.Module):
    """A pre-norm :class:`~dpzoo.seqrec.modeling.Block` with Re-Attention (§5.2.2):
    ``ReAttentionBlock(block)(x, key_mask, var, var_w)`` → ``(output, output variance)``.

    ``var`` (B, T) is the per-coordinate variance of ``x`` from the DP noise, ``var_w`` that of the
    noise on every weight. The block's own forward runs once, its attention logits corrected by
    the keys' variance; the output variance is then propagated, without gradient, through the
    intermediates it returns (LayerNorm, W_v, attention values, W_o, residual, LayerNorm, ff1,
    ReLU, ff2, residual). Dropout is ignored (eval-mode propagation). Holds no state of its own:
    the model wraps its blocks on the fly, so parameter names and checkpoints are the vanilla ones.
    """

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(
        self, x: torch.Tensor, key_mask: torch.Tensor, var: torch.Tensor, var_w: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.block
        with torch.no_grad():
            var_h = iso_layer_norm(x, var, b.ln1.weight, b.ln1.eps, var_w, var_w)
        out, tr = b(x, key_mask, score_correction=key_noise_correction(b.attn, var_h, var_w), return_trace=True)
        with torch.no_grad():
            var_v = iso_linear(tr.attn_input, var_h, b.attn.v.weight, var_w, var_w)
            var_mixed = iso_attention_values(tr.probs, var_v)
            var = iso_residual(var, iso_linear(tr.mixed, var_mixed, b.attn.o.weight, var_w, var_w))
            var_g = iso_layer_norm(tr.mid, var, b.ln2.weight, b.ln2.eps, var_w, var_w)
            var_pre = iso_linear(tr.ffn_input, var_g, b.ff1.weight, var_w, var_w)
            var_act = iso_relu(tr.pre, var_pre)
            var = iso_residual(var, iso_linear(tr.act, var_act, b.ff2.weight, var_w, var_w))
        return out, var
