"""The LLaMA-family decoders load real checkpoints unchanged: a Hugging Face directory of the same
layout as the hub's (transformers' own class, saved by save_pretrained, built here offline) loads
into llama-tiny-bias, qwen2-bias, mistral-bias and gemma-bias with every tensor kept, the BiTFiT-Add biases at
zero and the same logits; through ``weights=DIR`` and through the pretrained path (``pretrained=True``
with the directory as its tag, which is what the hub id resolves to once downloaded)."""

from __future__ import annotations

import pytest
import torch

import dpzoo

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip


def _original(kind):
    import transformers

    cls, config = {
        "llama-tiny-bias": ("LlamaForCausalLM", "LlamaConfig"),
        "qwen2-bias": ("Qwen2ForCausalLM", "Qwen2Config"),
        "mistral-bias": ("MistralForCausalLM", "MistralConfig"),
        "gemma-bias": ("GemmaForCausalLM", "GemmaConfig"),
    }[kind]
    extra = {"tie_word_embeddings": True} if kind in ("qwen2-bias", "gemma-bias") else {}
    if kind == "gemma-bias":
        extra["head_dim"] = 8
    torch.manual_seed(0)
    model = getattr(transformers, cls)(getattr(transformers, config)(**TINY, **extra)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):  # RMSNorm weights and Qwen2's q/k/v biases: not their init
                p.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("name", ["llama-tiny-bias", "qwen2-bias", "mistral-bias", "gemma-bias"])
@pytest.mark.parametrize("path", ["weights", "pretrained"])
def test_a_checkpoint_of_the_hub_layout_loads_unchanged(tmp_path, name, path):
    original = _original(name)
    original.save_pretrained(tmp_path / "hf")
    given = (
        {"weights": tmp_path / "hf"}
        if path == "weights"
        else {"pretrained": True, "pretrained_tag": str(tmp_path / "hf")}
    )
    model = dpzoo.load(name, **given).eval()
    ids = torch.randint(0, TINY["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, original(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    mine = dict(model.named_parameters())
    for key, tensor in original.state_dict().items():
        if key in mine:
            assert torch.equal(mine[key], tensor), key
    added = model.dpzoo_patch_report.biases_added
    assert added and all(float(mine[f"{m}.bias"].detach().abs().max()) == 0 for m in added)
    assert "model.layers.0.self_attn.o_proj" in added
    if name == "gemma-bias":  # its (1 + w) RMSNorms replaced by dpzoo's in that arithmetic
        assert model.model.layers[0].input_layernorm.style == "gemma"
    if name == "qwen2-bias":  # its own q/k/v biases kept (and loaded, above); the tied head recorded
        assert (
            "model.layers.0.self_attn.q_proj" not in added
            and mine["model.layers.0.self_attn.q_proj.bias"].abs().max() > 0
        )
        assert model.dpzoo_patch_report.tied_groups
