"""GPT-2 (Hugging Face ``GPT2LMHeadModel``) with its tied wte ↔ lm_head tracked."""

from __future__ import annotations

from pathlib import Path

from transformers import GPT2Config, GPT2LMHeadModel

from ..registry import ModelCard, register_model
from ._common import PATCH_OPTIONS
from ._hf import build_hf

ALIASES = {
    "num_layers": "n_layer",
    "width": "n_embd",
    "hidden_size": "n_embd",
    "num_heads": "n_head",
    "max_positions": "n_positions",
}

CARD = ModelCard(
    name="gpt2",
    summary="GPT-2 causal language model; the input embedding and output projection share one tensor, which dpzoo records.",
    architecture="transformers `GPT2LMHeadModel` (GPT-2 small by default: 12 layers, width 768, vocabulary 50257)",
    library="transformers",
    task="causal-lm",
    patches=(
        "none needed for biases: every Conv1D and LayerNorm has one; `lm_head` (tied to "
        "`transformer.wte`) stays without a bias",
        "tied parameters recorded: `transformer.wte.weight` = `lm_head.weight`",
        "position ids passed per sample (B, T), so the position embedding's gradient splits per sample",
        "in-place ops switched off where a module offers the switch",
    ),
    bias_exempt=("lm_head",),
    weight_source=(
        "random initialisation; `pretrained=True`: hub `openai-community/gpt2`; `weights=DIR`: a Hugging Face "
        'directory; any hub id is a tag too: `dpzoo.load("gpt2.org/model", pretrained=True)` or `pretrained_tag=`'
    ),
    pretrained_tags={"openai-community/gpt2": "Hugging Face hub (124M, MIT licence; LayerNorm: DP-ready as it is)"},
    license="MIT (OpenAI GPT-2 weights); Apache-2.0 (transformers code)",
    papers=(
        "Radford et al., Language Models are Unsupervised Multitask Learners, 2019",
        "Bu et al., DP-BiTFiT, ICML 2024: Table 1 (GPT2-small: 0.082% bias parameters)",
    ),
    overrides={
        "vocab_size": "vocabulary size",
        "num_layers": "blocks (n_layer)",
        "width": "model width (n_embd)",
        "num_heads": "attention heads (n_head)",
        "max_positions": "context length (n_positions)",
        "tie_word_embeddings": "tie lm_head to wte (default True)",
        "(any GPT2Config field)": "passed to the config",
        **PATCH_OPTIONS,
    },
    test_overrides={"vocab_size": 256, "num_layers": 2, "width": 32, "num_heads": 2, "max_positions": 64},
    example_input={"kind": "tokens", "vocab_size": 256, "seq_len": 16},
)


@register_model("gpt2", card=CARD)
def gpt2(pretrained: bool = False, pretrained_tag: str | None = None, weights=None, **overrides):
    vocab = overrides.get("vocab_size")
    config_from_overrides = not pretrained and (weights is None or not Path(weights).is_dir())
    if isinstance(vocab, int) and vocab <= 50256 and config_from_overrides:
        # GPT-2's bos/eos id 50256 must stay inside a smaller vocabulary: use the last token.
        overrides.setdefault("bos_token_id", vocab - 1)
        overrides.setdefault("eos_token_id", vocab - 1)
    return build_hf(
        "gpt2",
        GPT2LMHeadModel,
        GPT2Config,
        pretrained=pretrained,
        pretrained_tag=pretrained_tag,
        weights=weights,
        overrides=overrides,
        aliases=ALIASES,
        base_config={},
        head_keys=(),
        bias_exempt=("lm_head",),
        hub_id="openai-community/gpt2",
        per_sample_positions=True,
    )
