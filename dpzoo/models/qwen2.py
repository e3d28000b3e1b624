"""Qwen2 (Qwen2.5) decoders with BiTFiT-Add biases for DP-BiTFiT.

Qwen2 is LLaMA's architecture with biases on the query, key and value projections only (Qwen2
technical report, 2024, §2.1; transformers' ``Qwen2Attention``); BiTFiT-Add adds zero biases to
the output and MLP projections and to RMSNorm (DP-BiTFiT paper, §3.4), so every layer has a
bias to train. The small models tie ``lm_head`` to ``embed_tokens``; dpzoo records the tie.
"""

from __future__ import annotations

from transformers import Qwen2Config, Qwen2ForCausalLM

from ..registry import register_model
from .llama import build_decoder, decoder_card

HUB = "Qwen/Qwen2.5-0.5B"
_QWEN25_05B = {  # Qwen2.5-0.5B's config
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
}
_TEST = {"vocab_size": 256, "num_layers": 2, "width": 64, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128}

_READY = "Hugging Face hub (RMSNorm: DP-ready as it is)"


@register_model(
    "qwen2-bias",
    card=decoder_card(
        "qwen2-bias",
        "Qwen2 (Qwen2.5-0.5B configuration by default) with BiTFiT-Add biases beside its own q/k/v biases.",
        "Qwen2.5-0.5B configuration: 24 layers, width 896, tied embeddings",
        _TEST,
        hub=HUB,
        hub_note="",
        tags={HUB: _READY, "Qwen/Qwen2.5-1.5B": _READY},
        licence="Apache-2.0 (Qwen2.5-0.5B and -1.5B weights; transformers code)",
        papers=("Qwen Team, Qwen2 Technical Report, 2024",),
        cls="Qwen2ForCausalLM",
    ),
)
def qwen2_bias(pretrained: bool = False, pretrained_tag: str | None = None, weights=None, **overrides):
    return build_decoder(
        "qwen2-bias", Qwen2ForCausalLM, Qwen2Config, _QWEN25_05B, pretrained, pretrained_tag, weights, overrides, HUB
    )
