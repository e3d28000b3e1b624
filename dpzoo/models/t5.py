"""T5 (encoder-decoder) with BiTFiT-Add biases for DP fine-tuning of sequence-to-sequence tasks.

T5 has no bias terms at all (Raffel et al. 2020, §2.1): BiTFiT-Add adds zero biases to every
projection and replaces each ``T5LayerNorm`` (an RMS norm) by dpzoo's RMSNorm with a zero bias,
bit-identical outputs proven numerically when patched (DP-BiTFiT paper, §3.4). The shared
embedding is tied to the encoder's, the decoder's and (t5-small) the output head; dpzoo records
the tie and computes the cross terms of its per-sample norm.

The relative position bias of each stack's first attention layer is one table looked up for the
whole batch (no batch dimension), so its gradient has no per-sample form dpzoo computes: the
builder freezes it at its pretrained values (32 buckets × 8 heads per stack in t5-small), as the
card says. Every other parameter trains; unfreezing it is refused by name.
"""

from __future__ import annotations

from transformers import T5Config, T5ForConditionalGeneration

from ..registry import ModelCard, register_model
from ._common import PATCH_OPTIONS
from ._hf import build_hf

HUB = "google-t5/t5-small"
ALIASES = {
    "width": "d_model",
    "hidden_size": "d_model",
    "intermediate_size": "d_ff",
}
_T5_SMALL = {  # t5-small's config
    "vocab_size": 32128,
    "d_model": 512,
    "d_kv": 64,
    "d_ff": 2048,
    "num_layers": 6,
    "num_decoder_layers": 6,
    "num_heads": 8,
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "dropout_rate": 0.1,
    "layer_norm_epsilon": 1e-6,
    "feed_forward_proj": "relu",
    "tie_word_embeddings": True,
    "decoder_start_token_id": 0,
    "pad_token_id": 0,
    "eos_token_id": 1,
}
_TEST = {"vocab_size": 128, "width": 32, "d_kv": 8, "intermediate_size": 64, "num_layers": 2, "num_heads": 4}

CARD = ModelCard(
    name="t5-small",
    summary="T5-small encoder-decoder with BiTFiT-Add biases and its tied embeddings tracked, for DP sequence-to-sequence fine-tuning.",
    architecture="transformers `T5ForConditionalGeneration` (t5-small: 6 + 6 layers, width 512, 8 heads, vocabulary 32128)",
    library="transformers",
    task="text2text-generation",
    patches=(
        "BiTFiT-Add: a zero bias on q/k/v/o, the feed-forward projections (wi, wo) and every T5LayerNorm "
        "(→ dpzoo.nn.RMSNorm, style 't5': bit-identical outputs, proven numerically when patched); `lm_head` "
        "stays without a bias",
        "tied parameters recorded: `shared.weight` = `encoder.embed_tokens.weight` = `decoder.embed_tokens.weight`"
        " (= `lm_head.weight` when tie_word_embeddings)",
        "the relative position bias tables frozen (one lookup for the whole batch: no per-sample gradient)",
        "in-place ops switched off where a module offers the switch",
    ),
    bias_exempt=("lm_head",),
    weight_source=(
        f"random initialisation; `pretrained=True`: hub `{HUB}`; `weights=DIR`: a Hugging Face directory; any hub "
        'id is a tag too: `dpzoo.load("t5-small.org/model", pretrained=True)` or `pretrained_tag=`'
    ),
    pretrained_tags={HUB: "Hugging Face hub (60M, Apache-2.0; T5LayerNorm, an RMSNorm: DP-ready as it is)"},
    license="Apache-2.0 (T5 weights and transformers code)",
    papers=(
        "Raffel et al., Exploring the Limits of Transfer Learning with a Unified Text-to-Text Transformer, JMLR 2020",
        "Bu et al., DP-BiTFiT, ICML 2024: §3.4 (BiTFiT-Add)",
    ),
    overrides={
        "vocab_size": "vocabulary size",
        "width": "model width (d_model)",
        "d_kv": "size of each attention head",
        "intermediate_size": "feed-forward size (d_ff)",
        "num_layers": "encoder layers (and decoder layers unless num_decoder_layers)",
        "num_decoder_layers": "decoder layers",
        "num_heads": "attention heads",
        "tie_word_embeddings": "tie lm_head to the shared embedding (default True, as t5-small)",
        "(any T5Config field)": "passed to the config",
        **PATCH_OPTIONS,
    },
    test_overrides=_TEST,
    example_input={"kind": "seq2seq", "vocab_size": 128, "seq_len": 12, "target_len": 6},
    notes=(
        "Inputs: `input_ids` (and `attention_mask`) for the encoder, `decoder_input_ids` or `labels` for the "
        "decoder; a per-sample loss from the logits (dpzoo.losses) or the model's own `labels=` loss. The "
        "pretrained tag was not trained with GroupNorm or BatchNorm: its RMS norms and attention are DP-ready "
        "as they are, and only the zero biases and the frozen position tables change what trains."
    ),
)


@register_model("t5-small", card=CARD)
def t5_small(pretrained: bool = False, pretrained_tag: str | None = None, weights=None, **overrides):
    model = build_hf(
        "t5-small",
        T5ForConditionalGeneration,
        T5Config,
        pretrained=pretrained,
        pretrained_tag=pretrained_tag,
        weights=weights,
        overrides=overrides,
        aliases=ALIASES,
        base_config=_T5_SMALL,
        head_keys=(),
        bias_exempt=("lm_head",),
        hub_id=HUB,
    )
    for name, module in model.named_modules():
        if name.endswith("relative_attention_bias"):
            module.requires_grad_(False)  # a position table looked up once per batch: no per-sample gradient
    return model
