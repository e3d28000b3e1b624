"""t5-small: BiTFiT-Add on an encoder-decoder keeps transformers' outputs bit for bit (T5LayerNorm →
dpzoo's RMSNorm 't5' style, zero biases), the shared embedding's ties are recorded, a Hugging Face
directory loads through weights=DIR (the pretrained path is transformers' from_pretrained), the
relative position tables are frozen (and refused by name when unfrozen), and per-sample norms are
exact against per-sample backward passes in every mode, also through DP-SGD's clipped sum."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from grad_reference import check_against_brute_force, zoo_model_and_inputs
from transformers import T5Config, T5ForConditionalGeneration

import dpzoo
from dpzoo.errors import UnsupportedModuleError
from dpzoo.nn import RMSNorm

SMALL = dpzoo.model_card("t5-small").test_overrides


def _hf_t5(seed=0):
    torch.manual_seed(seed)
    config = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)  # fmt: skip
    model = T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                p.normal_(1.0, 0.2)  # away from ones: a misapplied norm weight shows
    return model


def _batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 128, (3, 9), generator=g), torch.randint(2, 128, (3, 5), generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_surgery_keeps_transformers_outputs_bit_for_bit(dtype):
    model = _hf_t5().to(dtype)
    ids, labels = _batch()
    expected = model(input_ids=ids, labels=labels).logits
    patched = dpzoo.make_dp_ready(model)
    assert torch.equal(patched(input_ids=ids, labels=labels).logits, expected)
    norms = [m for m in patched.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 12 and all(m.style == "t5" for m in norms)  # every T5LayerNorm: 2 + 3 per block, 2 finals
    report = patched.dpzoo_patch_report
    assert report.biases_added and not report.not_patched
    tied = [set(g.names) for g in report.tied_groups]
    assert {"shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"} in tied


def test_the_zoo_entry_trains_every_bias_and_freezes_only_the_position_tables():
    model = dpzoo.load("t5-small", **SMALL)
    frozen = sorted(n for n, p in model.named_parameters() if not p.requires_grad)
    assert frozen == [
        "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
        "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
    ]
    assert dpzoo.check_dp_ready(model, bias_exempt=("lm_head",), require_bias=True) == []
    model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.requires_grad_(True)
    with pytest.raises(UnsupportedModuleError, match="relative_attention_bias"):
        dpzoo.attach_norm_hooks(model)


def test_a_hugging_face_directory_loads_by_weights(tmp_path):
    source = _hf_t5()
    source.save_pretrained(tmp_path / "hf")
    model = dpzoo.load("t5-small", weights=tmp_path / "hf").eval()
    for name, m in source.named_modules():  # frozen as the zoo's are: SDPA's kernel depends on it (1e-7)
        if name.endswith("relative_attention_bias"):
            m.requires_grad_(False)
    ids, labels = _batch()
    assert torch.equal(model(input_ids=ids, labels=labels).logits, source(input_ids=ids, labels=labels).logits)
    dpzoo.save(model, tmp_path / "saved")
    again = dpzoo.load(tmp_path / "saved").eval()
    assert torch.equal(again(input_ids=ids, labels=labels).logits, source(input_ids=ids, labels=labels).logits)


@pytest.mark.parametrize("mode", ["ghost", "instantiate"])
def test_per_sample_norms_are_exact(mode):
    model, inputs, loss_fn = zoo_model_and_inputs("t5-small")
    check_against_brute_force(model, inputs, loss_fn, mode)


def test_a_dp_step_with_the_models_own_labels_loss_is_exact():
    """make_private with the usual seq2seq loss (the model's own `labels=` loss, a token mean per
    sample): the engine's first-step self-check compares it with per-sample backward passes."""
    model = dpzoo.load("t5-small", **SMALL).train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    ids, labels = torch.randint(2, 128, (16, 9)), torch.randint(2, 128, (16, 5))
    engine = dpzoo.PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
        data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, labels), batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        target_delta=1e-3,
        loss_reduction="sum",
    )
    for x, y in loader:
        if len(x):
            loss = F.cross_entropy(model(input_ids=x, labels=y).logits.flatten(0, 1), y.flatten(), reduction="none")
            loss.view(len(x), -1).mean(1).sum().backward()
            opt.step()
            opt.zero_grad()
            break
    assert engine.self_check_result is not None and "passed" in engine.self_check_result
