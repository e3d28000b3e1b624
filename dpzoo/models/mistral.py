"""Mistral decoders with BiTFiT-Add biases for DP-BiTFiT.

Mistral 7B is LLaMA's architecture with grouped-query attention and a sliding attention window
(Jiang et al., "Mistral 7B", 2023, §2; transformers' ``MistralForCausalLM``) and no bias terms;
BiTFiT-Add adds zero biases to every projection and to RMSNorm (DP-BiTFiT paper, §3.4). The
window and the attention pattern have no parameters, so the per-sample rules are LLaMA's.
"""

from __future__ import annotations

from transformers import MistralConfig, MistralForCausalLM

from ..registry import register_model
from .llama import build_decoder, decoder_card

HUB = "mistralai/Mistral-7B-v0.1"
_MISTRAL_7B = {  # Mistral-7B-v0.1's config
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5,
    "sliding_window": 4096,
}
_TEST = {"vocab_size": 256, "num_layers": 2, "width": 64, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128}


@register_model(
    "mistral-bias",
    card=decoder_card(
        "mistral-bias",
        "Mistral (Mistral-7B configuration by default) with zero biases added everywhere for DP-BiTFiT.",
        "Mistral-7B configuration: 32 layers, width 4096, 8 KV heads, sliding window 4096",
        _TEST,
        hub=HUB,
        hub_note="",
        tags={HUB: "Hugging Face hub (RMSNorm: DP-ready as it is)"},
        licence="Apache-2.0 (Mistral-7B-v0.1 weights; transformers code)",
        papers=("Jiang et al., Mistral 7B, 2023",),
        cls="MistralForCausalLM",
    ),
)
def mistral_bias(pretrained: bool = False, pretrained_tag: str | None = None, weights=None, **overrides):
    return build_decoder(
        "mistral-bias",
        MistralForCausalLM,
        MistralConfig,
        _MISTRAL_7B,
        pretrained,
        pretrained_tag,
        weights,
        overrides,
        HUB,
    )
