"""Shared test helpers: example inputs for zoo entries in their small configurations."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def example_batch(card, batch_size: int = 2, seed: int = 0):
    """(args, kwargs, loss_fn) for a zoo entry's example input in its small config."""
    g = torch.Generator().manual_seed(seed)
    spec = card.example_input
    if spec["kind"] in ("image", "features"):
        x = torch.randn(batch_size, *spec["shape"], generator=g)
        return (x,), {}
    if spec["kind"] == "tokens":
        ids = torch.randint(0, spec["vocab_size"], (batch_size, spec["seq_len"]), generator=g)
        return (), {"input_ids": ids}
    if spec["kind"] == "seq2seq":  # encoder input and decoder input
        ids = torch.randint(2, spec["vocab_size"], (batch_size, spec["seq_len"]), generator=g)
        target = torch.randint(2, spec["vocab_size"], (batch_size, spec["target_len"]), generator=g)
        return (), {"input_ids": ids, "decoder_input_ids": target}
    raise ValueError(spec)


def output_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    return out.logits


@pytest.fixture
def small_model():
    import dpzoo

    def make(name, **extra):
        card = dpzoo.model_card(name)
        return dpzoo.load(name, **{**card.test_overrides, **extra}), card

    return make
