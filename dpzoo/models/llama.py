"""LLaMA with BiTFiT-Add biases (DP-BiTFiT paper §3.4: LLaMA has no bias terms), and the card and
builder shared by the LLaMA-family decoders (:mod:`dpzoo.models.qwen2`, :mod:`dpzoo.models.mistral`)."""

from __future__ import annotations

from transformers import LlamaConfig, LlamaForCausalLM

from ..registry import ModelCard, register_model
from ._common import PATCH_OPTIONS
from ._hf import build_hf

ALIASES = {
    "num_layers": "num_hidden_layers",
    "width": "hidden_size",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "max_positions": "max_position_embeddings",
}
_PATCHES = (
    "BiTFiT-Add: a zero bias on q/k/v/o and gate/up/down projections",
    "RMSNorm → dpzoo.nn.RMSNorm with a zero bias (bit-identical outputs, proven numerically when patched)",
    "in-place ops switched off where a module offers the switch",
)
_OVERRIDES = {
    "vocab_size": "vocabulary size",
    "num_layers": "decoder layers",
    "width": "hidden size",
    "num_heads": "attention heads",
    "num_kv_heads": "key/value heads (grouped-query attention)",
    "intermediate_size": "MLP size",
    "max_positions": "context length",
    "tie_word_embeddings": "tie lm_head to embed_tokens (default False)",
    "(any LlamaConfig field)": "passed to the config",
    **PATCH_OPTIONS,
}
_LLAMA2_7B = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
}
_TINY = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
}


def decoder_card(name, summary, default, test, *, hub, hub_note, tags, licence, papers, cls="LlamaForCausalLM"):
    """The card of a LLaMA-family decoder with BiTFiT-Add biases: ``cls`` its transformers class,
    ``hub`` the checkpoint ``pretrained=True`` loads (``hub_note``: what to know first), ``tags``
    the card's pretrained tags."""
    return ModelCard(
        name=name,
        summary=summary,
        architecture=f"transformers `{cls}` ({default})",
        library="transformers",
        task="causal-lm",
        patches=_PATCHES,
        bias_exempt=("lm_head",),
        weight_source=(
            f"random initialisation; `pretrained=True`: hub `{hub}`{hub_note}; `weights=DIR`: a Hugging Face "
            f'directory; any hub id is a tag too: `dpzoo.load("{name}.org/model", pretrained=True)` or '
            '`pretrained_tag="org/model"`'
        ),
        pretrained_tags=tags,
        license=licence,
        papers=(*papers, "Bu et al., DP-BiTFiT, ICML 2024: §3.4 (BiTFiT-Add)"),
        overrides=_OVERRIDES,
        test_overrides=test,
        example_input={"kind": "tokens", "vocab_size": test.get("vocab_size", 256), "seq_len": 16},
        notes="The output head `lm_head` is left without a bias (a vocabulary-sized bias is rarely wanted).",
    )


def _card(name, summary, default, test):
    hub = "meta-llama/Llama-2-7b-hf"
    return decoder_card(
        name,
        summary,
        default,
        test,
        hub=hub,
        hub_note=" (gated: accept Meta's licence first)",
        tags={hub: "Hugging Face hub (gated; RMSNorm: DP-ready as it is)"} if name == "llama-bias" else {},
        licence="Llama 2 Community Licence (weights); Apache-2.0 (transformers code)",
        papers=("Touvron et al., Llama 2, 2023",),
    )


def build_decoder(name, model_cls, config_cls, base, pretrained, pretrained_tag, weights, overrides, hub_id=None):
    """A LLaMA-family decoder from transformers, made DP-ready with BiTFiT-Add biases."""
    return build_hf(
        name,
        model_cls,
        config_cls,
        pretrained=pretrained,
        pretrained_tag=pretrained_tag,
        weights=weights,
        overrides=overrides,
        aliases=ALIASES,
        base_config=base,
        head_keys=(),
        bias_exempt=("lm_head",),
        hub_id=hub_id,
    )


def _build(name, base, pretrained, pretrained_tag, weights, overrides):
    hub = "meta-llama/Llama-2-7b-hf" if name == "llama-bias" else None
    return build_decoder(name, LlamaForCausalLM, LlamaConfig, base, pretrained, pretrained_tag, weights, overrides, hub)


@register_model(
    "llama-bias",
    card=_card(
        "llama-bias",
        "LLaMA (Llama-2-7B configuration by default) with zero biases added everywhere for DP-BiTFiT.",
        "Llama-2-7B configuration: 32 layers, width 4096",
        {"vocab_size": 256, "num_layers": 2, "width": 64, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128},
    ),
)
def llama_bias(pretrained: bool = False, pretrained_tag: str | None = None, weights=None, **overrides):
    return _build("llama-bias", _LLAMA2_7B, pretrained, pretrained_tag, weights, overrides)


@register_model(
    "llama-tiny-bias",
    card=_card(
        "llama-tiny-bias",
        "A tiny LLaMA (2 layers, width 64, vocabulary 256, grouped-query attention) with BiTFiT-Add biases, for tests and CPU experiments.",
        "tiny configuration: 2 layers, width 64, 4 heads, 2 KV heads, vocabulary 256",
        {},
    ),
)
def llama_tiny_bias(pretrained: bool = False, pretrained_tag: str | None = None, weights=None, **overrides):
    return _build("llama-tiny-bias", _TINY, pretrained, pretrained_tag, weights, overrides)
