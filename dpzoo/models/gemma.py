"""Gemma decoders with BiTFiT-Add biases for DP-BiTFiT.

Gemma is LLaMA's architecture with GeGLU MLPs, multi-query attention in the 2B model, embeddings
scaled by √width and tied to the output, and an RMSNorm that scales by ``1 + w`` (Gemma Team,
"Gemma: Open Models Based on Gemini Research and Technology", 2024, §2; transformers'
``GemmaRMSNorm``). BiTFiT-Add adds zero biases to every projection (DP-BiTFiT paper, §3.4) and
replaces each RMSNorm by dpzoo's in its ``"gemma"`` arithmetic (proven bit-identical by probe),
which carries a bias too. The per-sample rule of ``w`` is LLaMA's: ∂((1 + w) ⊙ x̂)/∂w = x̂.
"""

from __future__ import annotations

from transformers import GemmaConfig, GemmaForCausalLM

from ..registry import register_model
from .llama import build_decoder, decoder_card

HUB = "google/gemma-2b"
_GEMMA_2B = {  # gemma-2b's config
    "vocab_size": 256000,
    "hidden_size": 2048,
    "intermediate_size": 16384,
    "num_hidden_layers": 18,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
_TEST = {
    "vocab_size": 256,
    "num_layers": 2,
    "width": 64,
    "num_heads": 4,
    "num_kv_heads": 1,
    "head_dim": 16,
    "intermediate_size": 128,
}


@register_model(
    "gemma-bias",
    card=decoder_card(
        "gemma-bias",
        "Gemma (gemma-2b configuration by default) with BiTFiT-Add biases, its (1 + w) RMSNorm made DP-ready.",
        "gemma-2b configuration: 18 layers, width 2048, multi-query attention, tied embeddings",
        _TEST,
        hub=HUB,
        hub_note=" (gated: accept Google's terms first)",
        tags={HUB: "Hugging Face hub (gated; RMSNorm: DP-ready as it is)"},
        licence="Gemma Terms of Use (weights); Apache-2.0 (transformers code)",
        papers=("Gemma Team, Gemma: Open Models Based on Gemini Research and Technology, 2024",),
        cls="GemmaForCausalLM",
    ),
)
def gemma_bias(pretrained: bool = False, pretrained_tag: str | None = None, weights=None, **overrides):
    return build_decoder(
        "gemma-bias", GemmaForCausalLM, GemmaConfig, _GEMMA_2B, pretrained, pretrained_tag, weights, overrides, HUB
    )
