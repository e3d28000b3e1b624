"""The sequential-recommendation zoo entries: ``transformer-seqrec``, ``transformer-seqrec-untied``,
``dpformer``, ``gru-seqrec`` and ``lstm-seqrec`` (their model cards and builders).

:func:`register` puts them in the registry; :mod:`dpzoo.models` calls it when it is imported
(the registry imports that package for the built-in entries). The shared override helpers come
from ``dpzoo.models._common`` inside :func:`register`, so this module imports nothing from
``dpzoo.models`` at import time and the two packages never import each other while loading.
"""

from __future__ import annotations

from torch import nn

from ..errors import CheckpointError
from ..registry import ModelCard, register_model
from ..surgery import make_dp_ready
from .configuration import SeqRecConfig
from .modeling import SeqRecRNN, SeqRecTransformer

__all__ = ["register", "ENTRIES"]

ENTRIES = ("transformer-seqrec", "transformer-seqrec-untied", "dpformer", "gru-seqrec", "lstm-seqrec")

_ARCH = {
    "num_items": "items (output classes = num_items + 1; id 0 is padding)",
    "max_len": "longest input sequence (positional embeddings)",
    "d_model": "model width (default 64)",
    "num_heads": "attention heads (default 1)",
    "num_blocks": "Transformer blocks (default 2)",
    "ffn_mult": "feed-forward width / d_model (default 1)",
    "dropout": "dropout (default 0.2)",
}
_TRANSFORMER_ONLY = ("num_heads", "num_blocks", "ffn_mult")
_TEST = {"num_items": 50, "max_len": 16, "d_model": 16, "num_heads": 2, "num_blocks": 2, "dropout": 0.0}
_RNN_TEST = {"num_items": 50, "max_len": 8, "d_model": 8, "dropout": 0.0}


def _transformer_card(name: str, tied: bool, reattention: bool, overrides: dict) -> ModelCard:
    if reattention:
        return ModelCard(
            name=name,
            summary=(
                "DPFormer: the tied causal Transformer for next-item prediction with Re-Attention, which "
                "debiases attention scores by the DP noise each key carries (long-tailed items are noisier)."
            ),
            architecture=(
                "dpzoo `SeqRecTransformer(reattention=True)`: d=64, 1 head, 2 pre-norm blocks, learned "
                "positions, tied full softmax, plus a parameter-free `ReAttention` state"
            ),
            library="dpzoo",
            task="sequential-recommendation",
            patches=(
                "written DP-ready: LayerNorm, biases on every Linear, no in-place ops, per-sample position ids",
                "tied: `item_emb.weight` = `out.weight` (exact per-sample norms by Phantom Clipping)",
                "Re-Attention: logits minus C·σ_k²/2 with σ_k² propagated from the effective errors "
                "(σ_dp·R/B per block weight, ÷ p_i per item embedding); no trainable parameters, the correction a "
                "constant (no gradient through it; the scores themselves train q and k)",
            ),
            weight_source="random initialisation (train with `dpzoo train dpformer`)",
            license="Apache-2.0",
            papers=(
                "DPFormer: Learning Differentially Private Transformer on Long-Tailed Data: §4 (Phantom "
                "Clipping), §5 (Re-Attention: Def. 5.1, Claims 5.3-5.4, eqs. 5.2, 5.5-5.7, App. C-D), App. E.2",
            ),
            overrides=overrides,
            test_overrides=dict(_TEST),
            example_input={"kind": "tokens", "vocab_size": _TEST["num_items"] + 1, "seq_len": _TEST["max_len"]},
            notes=(
                "The engine sets the noise (σ_dp, R, expected batch B) when the model is made private; "
                "`dpzoo train` sets the item and position frequencies from the training inputs. Until both "
                "are set the model computes exactly transformer-seqrec. The frequencies are treated as "
                "public, as the paper does (Remark C.1): see docs/DESIGN.md. MovieLens-1M runs beside the "
                "paper's Table 1, and why its gain does not show at this project's budget: docs/RESULTS.md."
            ),
        )
    return ModelCard(
        name=name,
        summary=(
            "Causal Transformer for next-item prediction with the item embedding tied to the output layer "
            "(the vanilla DP Transformer of the DPFormer paper)."
            if tied
            else "Causal Transformer for next-item prediction with separate input and output item embeddings "
            "(the paper's 'without parameter sharing' baseline)."
        ),
        architecture="dpzoo `SeqRecTransformer`: d=64, 1 head, 2 pre-norm blocks, learned positions, full softmax",
        library="dpzoo",
        task="sequential-recommendation",
        patches=(
            "written DP-ready: LayerNorm, biases on every Linear, no in-place ops, per-sample position ids",
            "tied: `item_emb.weight` = `out.weight` (exact per-sample norms by Phantom Clipping)"
            if tied
            else "untied: separate output layer",
        ),
        weight_source="random initialisation (train with `dpzoo train`)",
        license="Apache-2.0",
        papers=(
            "DPFormer: Learning Differentially Private Transformer on Long-Tailed Data: §4 (Phantom Clipping), "
            "§6 and App. E.2 (setting)",
            "Kang & McAuley, Self-Attentive Sequential Recommendation (SASRec), ICDM 2018",
        ),
        overrides=overrides,
        test_overrides=dict(_TEST),
        example_input={"kind": "tokens", "vocab_size": _TEST["num_items"] + 1, "seq_len": _TEST["max_len"]},
        notes="The same network with Re-Attention is the `dpformer` entry; GRU/LSTM baselines: `gru-seqrec`, `lstm-seqrec`.",
    )


def _rnn_card(name: str, cell: str, overrides: dict) -> ModelCard:
    return ModelCard(
        name=name,
        summary=f"{cell.upper()} baseline for next-item prediction (item embedding tied to the output layer), DP-ready.",
        architecture=f"dpzoo `SeqRecRNN`: item embedding d=64, one dpzoo.nn.DP{cell.upper()} layer, full softmax",
        library="dpzoo",
        task="sequential-recommendation",
        patches=(
            f"DP{cell.upper()} built from nn.Linear (torch's fused {cell.upper()} has no per-sample rule); same "
            "equations and gate order as torch",
            "tied: `item_emb.weight` = `out.weight`",
        ),
        weight_source="random initialisation (train with `dpzoo train`)",
        license="Apache-2.0",
        papers=("DPFormer: Learning Differentially Private Transformer on Long-Tailed Data: Table 1 baselines",),
        overrides={k: v for k, v in overrides.items() if k not in _TRANSFORMER_ONLY},
        test_overrides=dict(_RNN_TEST),
        example_input={"kind": "tokens", "vocab_size": _RNN_TEST["num_items"] + 1, "seq_len": _RNN_TEST["max_len"]},
    )


def _entry(name: str, card: ModelCard, make, split_patch_options, reject_unknown):
    """Register ``make(SeqRecConfig) -> nn.Module`` as ``name``: overrides checked against the card,
    dpzoo's surgery applied, weights loaded when given."""

    @register_model(name, card=card)
    def build(pretrained: bool = False, pretrained_tag: str | None = None, weights=None, **overrides) -> nn.Module:
        if pretrained:
            raise CheckpointError(f"{name} has no pretrained weights; train it with `dpzoo train {name}`.")
        arch, patch = split_patch_options(overrides)
        reject_unknown(name, arch, card.overrides)
        model = make_dp_ready(make(arch), groupnorm=False, **patch)
        if weights is not None:
            from ..hub.checkpoint import load_state_dict_checked, read_state_dict

            load_state_dict_checked(model, read_state_dict(weights), source=f"checkpoint {weights}")
        return model

    build.__name__ = build.__qualname__ = name.replace("-", "_")
    return build


_registered = False


def register() -> None:
    """Register the five entries (once; later calls do nothing)."""
    global _registered
    if _registered:
        return
    from ..models._common import PATCH_OPTIONS, reject_unknown, split_patch_options

    overrides = {**_ARCH, **PATCH_OPTIONS}
    helpers = (split_patch_options, reject_unknown)

    def transformer(tied: bool, reattention: bool = False):
        return lambda arch: SeqRecTransformer(SeqRecConfig(**{**arch, "tied": tied, "reattention": reattention}))

    def rnn(cell: str):
        return lambda arch: SeqRecRNN(SeqRecConfig(**arch), cell)

    for name, tied, reattention in (
        ("transformer-seqrec", True, False),
        ("transformer-seqrec-untied", False, False),
        ("dpformer", True, True),
    ):
        _entry(name, _transformer_card(name, tied, reattention, overrides), transformer(tied, reattention), *helpers)
    for name, cell in (("gru-seqrec", "gru"), ("lstm-seqrec", "lstm")):
        _entry(name, _rnn_card(name, cell, overrides), rnn(cell), *helpers)
    _registered = True
