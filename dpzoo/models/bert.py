"""BERT and RoBERTa sequence classifiers from Hugging Face transformers."""

from __future__ import annotations

from transformers import (
    BertConfig,
    BertForSequenceClassification,
    RobertaConfig,
    RobertaForSequenceClassification,
)

from ..registry import ModelCard, register_model
from ._common import PATCH_OPTIONS
from ._hf import build_hf

ALIASES = {
    "num_classes": "num_labels",
    "num_layers": "num_hidden_layers",
    "width": "hidden_size",
    "num_heads": "num_attention_heads",
    "max_positions": "max_position_embeddings",
}
_OVERRIDES = {
    "num_classes": "labels of the classification head (default 2)",
    "num_labels": "Hugging Face's name for `num_classes` (give one of the two)",
    "vocab_size": "vocabulary size",
    "num_layers": "Transformer layers",
    "width": "hidden size",
    "num_heads": "attention heads",
    "intermediate_size": "feed-forward size",
    "max_positions": "maximum sequence length",
    "(any config field)": "passed to the config",
    **PATCH_OPTIONS,
}
_PATCHES = (
    "none needed for biases: every Linear and LayerNorm has one",
    "BERT: position ids passed per sample (B, T), so the position embedding's gradient splits per sample "
    "(RoBERTa already derives them from input_ids)",
    "in-place ops switched off where a module offers the switch",
)


def _card(name, cls, hub, summary, licence, paper, test):
    return ModelCard(
        name=name,
        summary=summary,
        architecture=f"transformers `{cls}` (base size by default)",
        library="transformers",
        task="sequence-classification",
        patches=_PATCHES,
        weight_source=(
            f"random initialisation; `pretrained=True`: hub `{hub}` with a new head; "
            "`weights=DIR`: a Hugging Face directory (a base-model checkpoint gets a new head); any hub id is a "
            f'tag too: `dpzoo.load("{name}.org/model", pretrained=True)` or `pretrained_tag="org/model"`'
        ),
        pretrained_tags={hub: "Hugging Face hub (LayerNorm: DP-ready as it is)"},
        license=licence,
        papers=(paper, "Bu et al., DP-BiTFiT, ICML 2024: Table 1"),
        overrides=_OVERRIDES,
        test_overrides=test,
        example_input={"kind": "tokens", "vocab_size": test["vocab_size"], "seq_len": 16},
    )


BERT_CARD = _card(
    "bert-base",
    "BertForSequenceClassification",
    "google-bert/bert-base-uncased",
    "BERT-base sequence classifier.",
    "Apache-2.0",
    "Devlin et al., BERT, NAACL 2019",
    {
        "num_classes": 3,
        "vocab_size": 256,
        "num_layers": 2,
        "width": 32,
        "num_heads": 2,
        "intermediate_size": 64,
        "max_positions": 64,
    },
)
ROBERTA_CARD = _card(
    "roberta-base",
    "RobertaForSequenceClassification",
    "FacebookAI/roberta-base",
    "RoBERTa-base sequence classifier.",
    "MIT",
    "Liu et al., RoBERTa, 2019",
    {
        "num_classes": 3,
        "vocab_size": 256,
        "num_layers": 2,
        "width": 32,
        "num_heads": 2,
        "intermediate_size": 64,
        "max_positions": 66,
    },
)

_HEAD = ("classifier.*", "score.*")
_PRETRAINING_HEADS = ("cls.*", "lm_head.*", "pooler.*")


@register_model("bert-base", card=BERT_CARD)
def bert_base(pretrained: bool = False, pretrained_tag: str | None = None, weights=None, **overrides):
    return build_hf(
        "bert-base",
        BertForSequenceClassification,
        BertConfig,
        pretrained=pretrained,
        pretrained_tag=pretrained_tag,
        weights=weights,
        overrides=overrides,
        aliases=ALIASES,
        base_config={},
        head_keys=_HEAD + ("bert.pooler.*", "pooler.*"),
        ignorable_unexpected=("cls.*",),
        hub_id="google-bert/bert-base-uncased",
        per_sample_positions=True,
    )


@register_model("roberta-base", card=ROBERTA_CARD)
def roberta_base(pretrained: bool = False, pretrained_tag: str | None = None, weights=None, **overrides):
    base = {
        "vocab_size": 50265,
        "max_position_embeddings": 514,
        "type_vocab_size": 1,
        "layer_norm_eps": 1e-5,
        "pad_token_id": 1,
        "bos_token_id": 0,
        "eos_token_id": 2,
    }
    return build_hf(
        "roberta-base",
        RobertaForSequenceClassification,
        RobertaConfig,
        pretrained=pretrained,
        pretrained_tag=pretrained_tag,
        weights=weights,
        overrides=overrides,
        aliases=ALIASES,
        base_config=base,
        head_keys=_HEAD,
        ignorable_unexpected=_PRETRAINING_HEADS,
        hub_id="FacebookAI/roberta-base",
    )
