"""Hugging Face decoder layers that keep tokens batch-first, for per-sample gradients.

transformers' ``OPTDecoderLayer`` flattens its hidden states to (B·T, d) before its feed-forward
(``final_layer_norm``, ``fc1``, ``fc2``) and restores (B, T, d) after: those layers never see the
batch in dim 0, so dpzoo's hooks refuse them (which row belongs to which sample is lost). LayerNorm
and Linear act on the last dim only, so :class:`DPOPTDecoderLayer` computes the same function
without the reshape; dpzoo swaps it in by class (``layer.__class__ = DPOPTDecoderLayer``, every
parameter kept, pickling works).

The copy must compute what the installed transformers computes, and transformers changes this
forward between releases (5.24 renamed ``past_key_values`` to ``cache``). So the swap is decided by
behaviour, not by the source text: :func:`mirrors_installed` runs the installed forward and dpzoo's
copy on small float64 probe layers (pre- and post-LayerNorm, random weights, eval mode) and swaps
only when they agree to float64 rounding; attention arguments are passed through under whatever
names the caller used. A release that changes what the layer computes makes the check fail, and
the engine then refuses the model (``"flattened-tokens"``) instead of training it inexactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.opt.modeling_opt import OPTDecoderLayer

__all__ = ["DPOPTDecoderLayer", "mirrors_installed", "probe_mismatch", "FLATTENING_BLOCKS", "flattened_submodules"]

_PROBE = dict(batch=2, length=5, width=8, heads=2, ffn=12)


def _probe_layer(layer_norm_before: bool) -> OPTDecoderLayer:
    from transformers import OPTConfig

    cfg = OPTConfig(
        vocab_size=16,
        hidden_size=_PROBE["width"],
        num_attention_heads=_PROBE["heads"],
        ffn_dim=_PROBE["ffn"],
        num_hidden_layers=1,
        do_layer_norm_before=layer_norm_before,
        dropout=0.0,
        attention_dropout=0.0,
    )
    cfg._attn_implementation = "eager"
    gen = torch.Generator().manual_seed(0)
    layer = OPTDecoderLayer(cfg, layer_idx=0).double().eval()
    with torch.no_grad():
        for p in layer.parameters():  # non-trivial LayerNorm affines too
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return layer


PROBED: dict[type, tuple] = {}  # class -> (the forward probed, the verdict); clear() to probe again


def probe_mismatch(cls: type[torch.nn.Module]) -> str | None:
    """Why dpzoo's batch-first copy of ``cls`` does not compute what the installed ``cls.forward``
    computes on the float64 probes, or None when it does. Probed once per forward function (a
    forward patched later is probed again), on the CPU, with torch's global RNG left as it was."""
    if cls is not OPTDecoderLayer:
        return f"no probe for {cls.__name__}"
    seen = PROBED.get(cls)
    if seen is None or seen[0] is not cls.forward:
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            try:
                verdict = _probe(cls)
            except Exception as e:  # a changed signature or return type, or an unusable default device
                verdict = f"the probe failed: {type(e).__name__}: {e}"
        seen = PROBED[cls] = (cls.forward, verdict)
    return seen[1]


def _probe(cls: type[torch.nn.Module]) -> str | None:
    gen = torch.Generator().manual_seed(1)
    shape = (_PROBE["batch"], _PROBE["length"], _PROBE["width"])
    for before in (True, False):
        layer = _probe_layer(before)
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        mask = torch.zeros(shape[0], 1, shape[1], shape[1], dtype=torch.float64)
        mask[1, :, :, 0] = torch.finfo(torch.float64).min  # one masked key: the mask reaches attention
        pos = torch.arange(shape[1]).expand(shape[0], -1)
        with torch.no_grad():
            want = cls.forward(layer, x, attention_mask=mask, position_ids=pos, use_cache=False)
            got = DPOPTDecoderLayer.forward(layer, x, attention_mask=mask, position_ids=pos, use_cache=False)
        if not isinstance(want, torch.Tensor) or want.shape != got.shape:
            return f"the installed forward returns {type(want).__name__}, not a (B, T, d) tensor"
        err = (want - got).abs().max().item()
        if not err <= 1e-12 * max(1.0, want.abs().max().item()):
            return f"outputs differ by {err:.3g} (do_layer_norm_before={before})"
    return None


def mirrors_installed(cls: type[torch.nn.Module]) -> bool:
    """Whether dpzoo's batch-first copy computes what the installed ``cls.forward`` computes."""
    return probe_mismatch(cls) is None


class DPOPTDecoderLayer(OPTDecoderLayer):
    """``OPTDecoderLayer`` whose feed-forward runs on (B, T, d), not on flattened (B·T, d) tokens."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        use_cache: bool | None = False,
        **attention_kwargs,
    ) -> torch.Tensor:
        # the cache (``past_key_values`` before transformers 5.24, ``cache`` after), position ids and
        # the rest go to the attention under the caller's names, as the installed forward does
        residual = hidden_states
        if self.do_layer_norm_before:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states, attention_mask=attention_mask, **attention_kwargs
        )
        hidden_states = F.dropout(hidden_states, p=self.dropout, training=self.training)
        hidden_states = residual + hidden_states
        if not self.do_layer_norm_before:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        residual = hidden_states  # (B, T, d): no reshape to (B·T, d)
        if self.do_layer_norm_before:
            hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = self.fc2(self.activation_fn(self.fc1(hidden_states)))
        hidden_states = F.dropout(hidden_states, p=self.dropout, training=self.training)
        hidden_states = residual + hidden_states
        if not self.do_layer_norm_before:
            hidden_states = self.final_layer_norm(hidden_states)
        return hidden_states


# class -> its batch-first replacement (swapped by class, see dpzoo.surgery.layers)
FLATTENING_BLOCKS: dict[type, type] = {OPTDecoderLayer: DPOPTDecoderLayer}


def flattened_submodules(module) -> tuple[str, ...]:
    """Names of the submodules ``module`` (exactly a class of :data:`FLATTENING_BLOCKS`) calls on
    flattened (B·T, d) tokens; () for any other module."""
    if type(module) is OPTDecoderLayer:
        return ("final_layer_norm", "fc1", "fc2") if module.do_layer_norm_before else ("fc1", "fc2")
    return ()
