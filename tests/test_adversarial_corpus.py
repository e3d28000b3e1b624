"""dpzoo's own adversarial corpus (issue 13): models and usages outside the zoo, each either
exact or refused, never silently wrong.

Every case is (a model factory, a batch, a per-sample-summed loss), in float64. For each case
the harness

1. attaches ``dpzoo.attach_norm_hooks(model, mode)`` for every mode (and, where declared, both
   ``loss.backward()`` and ``hooks.backward(loss)``), runs forward and backward, then
   ``per_param_norms()`` and ``clipped_sum(scale)``; a :class:`dpzoo.DPZooError` there means the
   run was *refused by the hooks*;
2. if no run was refused and ``dpzoo.verify`` exists, calls ``dpzoo.verify(model, inputs,
   loss_fn)`` (a few samples re-run alone); a :class:`dpzoo.DPZooError` means *refused by the
   self-check*;
3. otherwise compares the per-parameter norms and the clipped sum with a loop of per-sample
   backward passes (float64, relative 1e-6).

Each case declares "exact" or "refused". A case the hooks get silently wrong is declared
"refused" and marked ``# caught by the self-check only``: it passes only once ``dpzoo.verify``
catches it (it fails, on purpose, where ``dpzoo.verify`` is missing or misses it). No case may be
silently wrong: a crash that is not a DPZooError fails too.

The losses never need labels: each output tensor gets a fixed random probe (the same for every
sample: it broadcasts over the batch), so ``loss_fn`` works on any batch, one sample included.

Run ``python tests/test_adversarial_corpus.py`` for the table of outcomes.
"""

from __future__ import annotations

import functools
import random
import zlib
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import dpzoo

F64 = torch.float64
MODES = ("ghost", "instantiate", "auto")
RTOL = 1e-6

pytestmark = [
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


# =============================================================================================
# harness
# =============================================================================================


@dataclass
class Case:
    model: nn.Module
    inputs: object  # a batch-first tensor, a tuple of positional args or a dict of kwargs
    loss_fn: Callable  # loss_fn(output) -> scalar, per-sample losses summed
    backwards: tuple = ("loss",)  # "loss": loss.backward(); "hooks": hooks.backward(loss)
    batch_size: int | None = None
    notes: list = field(default_factory=list)


def _call(model, inputs):
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def _tensors(inputs):
    if isinstance(inputs, dict):
        return [v for v in inputs.values() if isinstance(v, torch.Tensor)]
    if isinstance(inputs, tuple):
        return [v for v in inputs if isinstance(v, torch.Tensor)]
    return [inputs]


def _slice(inputs, i, b):
    def one(v):
        return v[i : i + 1] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == b else v

    if isinstance(inputs, dict):
        return {k: one(v) for k, v in inputs.items()}
    if isinstance(inputs, tuple):
        return tuple(one(v) for v in inputs)
    return one(inputs)


def _probe(shape, dtype):
    g = torch.Generator().manual_seed(zlib.crc32(repr(tuple(shape)).encode()))
    return torch.randn(tuple(shape), generator=g, dtype=dtype)


def _out_tensors(out):
    found, stack = [], [out]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            if o.is_floating_point() and o.requires_grad and o.dim() > 0:
                found.append(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
    return found


def probe_loss(out):
    """Σ over the output's float tensors of ⟨t, P⟩ + ½‖t‖², P a fixed random tensor of t.shape[1:]
    (broadcast over the batch): a per-sample loss, summed, that needs no labels."""
    total = 0
    for t in _out_tensors(out):
        total = total + (t * _probe(t.shape[1:], t.dtype)).sum() + 0.5 * t.pow(2).sum()
    return total


def per_sample_reference(case: Case, b: int):
    params = {n: p for n, p in case.model.named_parameters() if p.requires_grad}
    grads = []
    for i in range(b):
        for p in params.values():
            p.grad = None
        case.loss_fn(_call(case.model, _slice(case.inputs, i, b))).backward()
        grads.append(
            {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for n, p in params.items()}
        )
    for p in params.values():
        p.grad = None
    return grads


def _rel_err(actual, expected, floor):
    actual, expected = actual.detach().to(F64), expected.detach().to(F64)
    scale = max(expected.abs().max().item() if expected.numel() else 0.0, floor)
    return (actual - expected).abs().max().item() / scale if expected.numel() else 0.0


def _run_hooks(case: Case, mode: str, backward: str, scale: torch.Tensor):
    """(per-parameter norms, clipped sums) or a DPZooError."""
    hooks = dpzoo.attach_norm_hooks(case.model, mode)
    try:
        loss = case.loss_fn(_call(case.model, case.inputs))
        if backward == "hooks":
            hooks.backward(loss)
        else:
            loss.backward()
        norms = {n: v.detach().clone() for n, v in hooks.per_param_norms().items()}
        sums = {n: v.detach().clone() for n, v in hooks.clipped_sum(scale).items()}
        return norms, sums
    finally:
        hooks.detach()
        for p in case.model.parameters():
            p.grad = None


def run_case(case: Case) -> tuple[str, str]:
    """("exact" | "refused-by-hooks" | "refused-by-verify" | "WRONG", detail)."""
    b = case.batch_size or _tensors(case.inputs)[0].shape[0]
    scale = torch.rand(b, generator=torch.Generator().manual_seed(11), dtype=F64) + 0.1
    results, refusals = {}, {}
    for mode in MODES:
        for backward in case.backwards:
            try:
                results[mode, backward] = _run_hooks(case, mode, backward, scale)
            except dpzoo.DPZooError as e:
                refusals[mode, backward] = f"{type(e).__name__}: {e}"
    if refusals and not results:
        return "refused-by-hooks", next(iter(refusals.values()))
    verify = getattr(dpzoo, "verify", None)
    if verify is not None:
        try:
            verify(case.model, case.inputs, case.loss_fn)
        except dpzoo.DPZooError as e:
            return "refused-by-verify", f"{type(e).__name__}: {e}"
    grads = per_sample_reference(case, b)
    names = list(grads[0])
    total = torch.stack([torch.sqrt(sum(g[n].pow(2).sum() for n in names)) for g in grads])
    floor = RTOL * total.abs().max().item()  # a parameter's norm is compared at the model's scale
    wrong = []
    for (mode, backward), (norms, sums) in results.items():
        if set(norms) != set(names):
            wrong.append(f"[{mode}/{backward}] parameters {sorted(set(norms) ^ set(names))[:4]} differ")
            continue
        for n in names:
            exp_norm = torch.stack([g[n].flatten().norm() for g in grads])
            exp_sum = sum(scale[i] * grads[i][n] for i in range(b))
            e1 = _rel_err(norms[n], exp_norm, floor)
            e2 = _rel_err(sums[n], exp_sum, floor) if sums[n].shape == exp_sum.shape else float("inf")
            if max(e1, e2) > RTOL:
                wrong.append(f"[{mode}/{backward}] {n}: norm error {e1:.1e}, clipped-sum error {e2:.1e}")
    if wrong:
        more = f" (+{len(wrong) - 3} more)" if len(wrong) > 3 else ""
        return "WRONG", "; ".join(wrong[:3]) + more
    if refusals:  # some ways of running it refused, the others exact
        return "refused-by-hooks", next(iter(refusals.values()))
    return "exact", ""


# =============================================================================================
# helpers for the cases
# =============================================================================================


def _rng(name: str) -> random.Random:
    return random.Random(zlib.crc32(name.encode()))


def _x(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _ids(b, t, vocab, seed=2, low=0):
    return torch.randint(low, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def _perturb(model, seed=0, std=0.2):
    """Non-trivial values everywhere (zero-initialised biases, unit norm weights, ...)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)
    return model


def _f64(model, perturb=True, train=True):
    model = model.to(F64).train(train)
    return _perturb(model) if perturb else model


class Head(nn.Module):
    def __init__(self, layer, pre=None):
        super().__init__()
        self.layer, self.pre = layer, pre

    def forward(self, x):
        return self.layer(self.pre(x) if self.pre is not None else x)


# --- timm ---------------------------------------------------------------------------------------


def _timm(name, img=32, b=2, dp_ready=False, train=True, **kw):
    import timm

    torch.manual_seed(0)
    m = timm.create_model(name, pretrained=False, num_classes=3, **kw)
    if dp_ready:
        m = dpzoo.make_dp_ready(m)
    return Case(_f64(m, train=train), _x(b, 3, img, img), probe_loss)


def _timm_vit(b=3, img=16, **kw):
    import timm

    torch.manual_seed(0)
    args = dict(img_size=img, patch_size=8, depth=1, embed_dim=16, num_heads=2, num_classes=3)
    args.update(kw)
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, **args)
    return m, b


def _convnext(dp_ready=False, **kw):
    from timm.models.convnext import ConvNeXt  # timm.create_model drops None keyword arguments

    torch.manual_seed(0)
    m = ConvNeXt(depths=(1, 1, 1, 1), dims=(8, 8, 16, 16), num_classes=3, **kw)
    return Case(_f64(dpzoo.make_dp_ready(m) if dp_ready else m), _x(2, 3, 32, 32), probe_loss)


def timm_convnext_layerscale():
    return _convnext()


def timm_convnext_layerscale_dp_ready():
    return _convnext(dp_ready=True)


def timm_convnext_conv_mlp_layerscale_dp_ready():
    return _convnext(dp_ready=True, conv_mlp=True)


def timm_convnext_no_layerscale():
    return _convnext(ls_init_value=None)


def timm_convnext_conv_mlp():
    return _convnext(ls_init_value=None, conv_mlp=True)


def timm_mobilenetv3_bn():
    return _timm("mobilenetv3_small_050", img=32)


def timm_mobilenetv3_dp_ready():
    return _timm("mobilenetv3_small_050", img=32, dp_ready=True)


def timm_efficientnet_bn():
    return _timm("test_efficientnet", img=32)


def timm_efficientnet_dp_ready():
    return _timm("test_efficientnet", img=32, dp_ready=True)


def timm_efficientnet_gn_inplace():
    return _timm("test_efficientnet_gn", img=32)  # in-place activations (timm's default)


def timm_efficientnet_gn():
    case = _timm("test_efficientnet_gn", img=32)
    dpzoo.surgery.disable_inplace(case.model)
    return case


def timm_efficientnet_evonorm():
    return _timm("test_efficientnet_evos", img=32)


def timm_efficientnet_same_padding_dp_ready():
    # pad_type='same' (the tf_ variants): Conv2dSame, 'SAME' padding computed from the input size in forward
    return _timm("test_efficientnet", img=33, dp_ready=True, pad_type="same")


def timm_vit_reg_tokens_token_pool_layerscale_qknorm():
    m, b = _timm_vit(reg_tokens=2, class_token=True, global_pool="token", init_values=0.1, qk_norm=True)
    return Case(_f64(m), _x(b, 3, 16, 16), probe_loss)


def timm_vit_map_pool_reg_tokens_cls():
    m, b = _timm_vit(reg_tokens=1, class_token=True, global_pool="map", init_values=0.1)
    return Case(_f64(m), _x(b, 3, 16, 16), probe_loss)


def timm_vit_dynamic_img_size():
    # pos_embed resampled to the input's grid inside forward (resample_abs_pos_embed reshapes it to 1 x ...):
    # the per-sample (B, N, D) copy dpzoo swaps in for the loose pos_embed would break it: refused at
    # attach (the ViT's loose-tensor check)
    m, b = _timm_vit(dynamic_img_size=True)
    return Case(_f64(m), _x(b, 3, 24, 24), probe_loss)


def timm_deit_distilled():
    import timm

    torch.manual_seed(0)
    m = timm.create_model(
        "deit_tiny_distilled_patch16_224",
        pretrained=False,
        img_size=16,
        patch_size=8,
        depth=1,
        embed_dim=16,
        num_heads=2,
        num_classes=3,
    )
    return Case(_f64(m), _x(3, 3, 16, 16), probe_loss)


def timm_resnetv2_bit_stdconv():
    from timm.layers import GroupNormAct
    from timm.models.resnetv2 import ResNetV2

    torch.manual_seed(0)
    m = ResNetV2(
        layers=(1, 1),
        channels=(16, 32),
        stem_chs=8,
        num_classes=3,
        norm_layer=functools.partial(GroupNormAct, num_groups=4),
    )
    dpzoo.surgery.disable_inplace(m)
    return Case(_f64(m), _x(2, 3, 32, 32), probe_loss)


def timm_nfnet_scaled_stdconv():
    case = _timm("test_nfnet", img=32)
    dpzoo.surgery.disable_inplace(case.model)
    return case


def _regnet(dp_ready):
    from timm.models.regnet import RegNet, RegNetCfg

    torch.manual_seed(0)  # four one-block stages, grouped convolutions, squeeze-excitation
    m = RegNet(RegNetCfg(depth=4, w0=8, wa=12, wm=1.5, group_size=8, se_ratio=0.25, stem_width=8), num_classes=3)
    if dp_ready:
        m = dpzoo.make_dp_ready(m)
    return Case(_f64(m), _x(2, 3, 32, 32), probe_loss)


def timm_regnet_bn():
    return _regnet(False)


def timm_regnet_dp_ready():
    return _regnet(True)


def timm_resnet_dp_ready():
    return _timm("test_resnet", img=32, dp_ready=True)


def timm_mixer():
    from timm.models.mlp_mixer import MlpMixer

    torch.manual_seed(0)
    m = MlpMixer(num_classes=3, img_size=16, patch_size=8, num_blocks=1, embed_dim=16)
    return Case(_f64(m), _x(3, 3, 16, 16), probe_loss)


def timm_resmlp_affine():
    from timm.models.mlp_mixer import Affine, MlpMixer, ResBlock

    torch.manual_seed(0)
    m = MlpMixer(
        num_classes=3,
        img_size=16,
        patch_size=8,
        num_blocks=1,
        embed_dim=16,
        mlp_ratio=4,
        block_layer=ResBlock,
        norm_layer=Affine,
        stem_norm=False,
    )
    return Case(_f64(m), _x(3, 3, 16, 16), probe_loss)


def timm_poolformer():
    from timm.models.metaformer import MetaFormer

    torch.manual_seed(0)
    m = MetaFormer(depths=(1, 1, 1, 1), dims=(8, 8, 16, 16), num_classes=3)  # poolformer v2: Scale, StarReLU
    return Case(_f64(m), _x(2, 3, 32, 32), probe_loss)


def timm_swin_relative_position_bias():
    return _timm(
        "swin_tiny_patch4_window7_224",
        img=16,
        img_size=16,
        patch_size=2,
        window_size=4,
        embed_dim=8,
        depths=(1,),
        num_heads=(2,),
    )


def timm_eva():
    return _timm("eva02_tiny_patch14_224", img=16, img_size=16, patch_size=8, depth=1, embed_dim=16, num_heads=2)


# --- Hugging Face transformers ------------------------------------------------------------------


def _hf(cls_name, config_name, **cfg):
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**cfg)
    return getattr(transformers, cls_name)(config)


_BERT = dict(
    vocab_size=30,
    hidden_size=8,
    num_hidden_layers=1,
    num_attention_heads=2,
    intermediate_size=16,
    max_position_embeddings=16,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)


def _mask(b, t, seed=3):
    mask = torch.ones(b, t, dtype=torch.long)
    mask[0, t - 2 :] = 0  # right padding on sample 0
    return mask


def hf_bert_sequence_classification():
    m = _hf("BertForSequenceClassification", "BertConfig", type_vocab_size=2, num_labels=3, **_BERT)
    b, t = 3, 6
    tt = torch.zeros(b, t, dtype=torch.long)
    tt[:, 3:] = 1
    inputs = {"input_ids": _ids(b, t, 30), "attention_mask": _mask(b, t), "token_type_ids": tt}
    return Case(_f64(m), inputs, lambda out: probe_loss(out.logits))


def hf_distilbert_masked_lm_tied():
    m = _hf(
        "DistilBertForMaskedLM",
        "DistilBertConfig",
        vocab_size=30,
        dim=8,
        n_layers=1,
        n_heads=2,
        hidden_dim=16,
        max_position_embeddings=16,
        dropout=0.0,
        attention_dropout=0.0,
    )
    return Case(
        _f64(m), {"input_ids": _ids(3, 5, 30), "attention_mask": _mask(3, 5)}, lambda out: probe_loss(out.logits)
    )


def _roberta(cls):
    m = _hf(cls, "RobertaConfig", pad_token_id=1, num_labels=3, **{**_BERT, "max_position_embeddings": 20})
    ids = _ids(3, 6, 30, low=2)
    ids[0, 4:] = 1  # padding: position ids computed from input_ids (padding_idx positions)
    mask = (ids != 1).long()
    return Case(_f64(m), {"input_ids": ids, "attention_mask": mask}, lambda out: probe_loss(out.logits))


def hf_roberta_padding_idx_positions():
    return _roberta("RobertaForSequenceClassification")


def hf_roberta_mlm_head_bias():
    # RobertaLMHead.bias is decoder.bias (one tensor, two owners): the owner without a rule refuses
    return _roberta("RobertaForMaskedLM")


def _gpt2_cfg(**extra):
    return dict(
        n_layer=1,
        n_head=2,
        n_embd=8,
        vocab_size=20,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
        **extra,
    )


def hf_gpt2_sequence_classification():
    m = _hf("GPT2ForSequenceClassification", "GPT2Config", num_labels=3, pad_token_id=0, **_gpt2_cfg())
    ids = _ids(3, 6, 20, low=1)
    ids[1, 4:] = 0  # last non-pad token pooling
    return Case(_f64(m), {"input_ids": ids, "attention_mask": (ids != 0).long()}, lambda out: probe_loss(out.logits))


def hf_gpt2_labels_mean_loss():
    # HF's own loss: the mean over every token of the batch, not a sum of per-sample losses
    # caught by the self-check only
    m = _hf("GPT2LMHeadModel", "GPT2Config", **_gpt2_cfg())
    ids = _ids(3, 6, 20)
    return Case(_f64(m), {"input_ids": ids, "labels": ids}, lambda out: out.loss)


def hf_opt_learned_positions():
    m = _hf(
        "OPTForCausalLM",
        "OPTConfig",
        vocab_size=20,
        hidden_size=8,
        num_hidden_layers=1,
        ffn_dim=16,
        num_attention_heads=2,
        max_position_embeddings=16,
        word_embed_proj_dim=8,
        dropout=0.0,
        attention_dropout=0.0,
        use_cache=False,
    )
    return Case(
        _f64(m), {"input_ids": _ids(3, 5, 20), "attention_mask": _mask(3, 5)}, lambda out: probe_loss(out.logits)
    )


_LLAMA = dict(
    vocab_size=20,
    hidden_size=8,
    intermediate_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=16,
    use_cache=False,
)


def hf_llama_causal_lm():
    m = _hf("LlamaForCausalLM", "LlamaConfig", **_LLAMA)
    return Case(
        _f64(m), {"input_ids": _ids(3, 5, 20), "attention_mask": _mask(3, 5)}, lambda out: probe_loss(out.logits)
    )


def hf_llama_gradient_checkpointing():
    m = _hf("LlamaForCausalLM", "LlamaConfig", **{**_LLAMA, "num_hidden_layers": 2})
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return Case(_f64(m), {"input_ids": _ids(2, 5, 20)}, lambda out: probe_loss(out.logits), backwards=("loss", "hooks"))


_T5 = dict(
    vocab_size=20,
    d_model=8,
    d_kv=4,
    d_ff=16,
    num_layers=1,
    num_decoder_layers=1,
    num_heads=2,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=16,
    dropout_rate=0.0,
    decoder_start_token_id=0,
    pad_token_id=0,
    use_cache=False,
)


def _t5(b, t_enc, t_dec):
    m = _hf("T5ForConditionalGeneration", "T5Config", **_T5)
    for mod in m.modules():  # T5LayerNorm has no rule: frozen, to reach relative_attention_bias
        if type(mod).__name__ == "T5LayerNorm":
            mod.weight.requires_grad_(False)
    inputs = {"input_ids": _ids(b, t_enc, 20, low=1), "decoder_input_ids": _ids(b, t_dec, 20, seed=5, low=1)}
    return Case(_f64(m), inputs, lambda out: probe_loss(out.logits))


def hf_t5_T_ne_B():
    # relative_attention_bias: an Embedding looked up with (T, T) relative-position ids
    return _t5(2, 5, 4)


def hf_t5_T_eq_B():
    # T == B: the (T, T) ids pass for a batch; the rows are query positions, not samples. Refused by
    # module (rules.loose.SHARED_LOOKUPS) since issue 33, not left to the self-check
    return _t5(3, 3, 3)


def hf_t5_relative_bias_frozen_T_eq_B():
    # the same shapes with every relative-position table frozen: the rest is exact
    case = _t5(3, 3, 3)
    for n, p in case.model.named_parameters():
        if "relative_attention_bias" in n:
            p.requires_grad_(False)
    return case


def hf_t5_decoder_length_1():
    # the decoder's (1, 1) relative-position ids look like batch-1 ids; dpzoo expands batch-1 lookups
    # only for owners declared to broadcast them (BROADCAST_LOOKUPS), so this one is refused by the
    # batch check
    case = _t5(3, 4, 1)
    case.model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.requires_grad_(False)
    return case


def hf_bart_learned_positions():
    m = _hf(
        "BartForConditionalGeneration",
        "BartConfig",
        vocab_size=20,
        d_model=8,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=16,
        decoder_ffn_dim=16,
        max_position_embeddings=16,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        use_cache=False,
    )
    return Case(
        _f64(m),
        {"input_ids": _ids(2, 5, 20, low=3), "decoder_input_ids": _ids(2, 4, 20, seed=5, low=3)},
        lambda out: probe_loss(out.logits),
    )


def hf_vit():
    m = _hf(
        "ViTForImageClassification",
        "ViTConfig",
        image_size=16,
        patch_size=8,
        num_channels=3,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return Case(_f64(m), {"pixel_values": _x(3, 3, 16, 16)}, lambda out: probe_loss(out.logits))


def hf_clip_text_position_embeddings():
    m = _hf(
        "CLIPTextModel",
        "CLIPTextConfig",
        vocab_size=30,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=16,
        eos_token_id=29,
        attention_dropout=0.0,
    )
    ids = _ids(3, 6, 29)
    ids[:, -1] = 29
    return Case(_f64(m), {"input_ids": ids}, lambda out: probe_loss((out.last_hidden_state, out.pooler_output)))


def hf_albert_shared_layers():
    # one layer group applied num_hidden_layers times (a module called several times), factorised embeddings
    m = _hf(
        "AlbertForSequenceClassification",
        "AlbertConfig",
        num_labels=3,
        vocab_size=30,
        embedding_size=4,
        hidden_size=8,
        num_hidden_layers=3,
        num_hidden_groups=1,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0,
    )
    return Case(
        _f64(m), {"input_ids": _ids(3, 5, 30), "attention_mask": _mask(3, 5)}, lambda out: probe_loss(out.logits)
    )


def hf_convnext():
    m = _hf(
        "ConvNextForImageClassification",
        "ConvNextConfig",
        num_channels=3,
        hidden_sizes=[8, 16],
        depths=[1, 1],
        num_stages=2,
        num_labels=3,
    )
    return Case(_f64(m), {"pixel_values": _x(2, 3, 32, 32)}, lambda out: probe_loss(out.logits))


# --- custom modules -----------------------------------------------------------------------------


class TimeMajorRNN(nn.Module):
    """Batch-first in and out; inside, an Elman/LSTM-like recurrence run time-major on (T, B, D)."""

    def __init__(self, d=4, h=5):
        super().__init__()
        self.ih, self.hh, self.out = nn.Linear(d, h), nn.Linear(h, h), nn.Linear(h, 2)

    def forward(self, x):  # x: (B, T, D)
        xs = self.ih(x.transpose(0, 1))  # (T, B, H): the Linear sees T rows
        h = torch.zeros_like(xs[0])
        outs = []
        for t in range(xs.shape[0]):
            h = torch.tanh(xs[t] + self.hh(h))  # (B, H): batch-first
            outs.append(h)
        return self.out(torch.stack(outs, 1))


def custom_time_major_rnn_T_ne_B():
    torch.manual_seed(0)
    return Case(_f64(TimeMajorRNN()), _x(3, 5, 4), probe_loss)


def custom_time_major_rnn_T_eq_B():
    # caught by the self-check only
    torch.manual_seed(0)
    return Case(_f64(TimeMajorRNN()), _x(3, 3, 4), probe_loss)


class TorchRNNTimeMajor(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.rnn = (nn.GRU if kind == "gru" else nn.LSTM)(4, 5)  # batch_first=False
        self.out = nn.Linear(5, 2)

    def forward(self, x):
        return self.out(self.rnn(x.transpose(0, 1))[0]).transpose(0, 1)


def custom_torch_gru_time_major():
    torch.manual_seed(0)
    return Case(_f64(TorchRNNTimeMajor("gru")), _x(3, 3, 4), probe_loss)


def custom_dpzoo_lstm_batch_first():
    torch.manual_seed(0)

    class Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.head = dpzoo.nn.DPLSTM(4, 5), nn.Linear(5, 2)

        def forward(self, x):
            return self.head(self.rnn(x)[0])

    return Case(_f64(Seq()), _x(3, 4, 4), probe_loss)


class TimeMajorAttention(nn.Module):
    """A transformer block of Linear layers run sequence-first on (T, B, D) (fairseq style)."""

    def __init__(self, d=8, heads=2):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.norm = nn.LayerNorm(d)
        self.ff = nn.Linear(d, d)

    def forward(self, x):  # (B, T, D)
        x = x.transpose(0, 1)  # (T, B, D)
        t, b, d = x.shape

        def split(z):
            return z.reshape(t, b * self.heads, d // self.heads).transpose(0, 1)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        a = torch.softmax(q @ k.transpose(1, 2) / (d // self.heads) ** 0.5, -1) @ v  # (B*H, T, d/H)
        x = x + self.o(a.transpose(0, 1).reshape(t, b, d))
        x = x + self.ff(torch.tanh(self.norm(x)))
        return x.transpose(0, 1)


def custom_time_major_transformer_T_ne_B():
    torch.manual_seed(0)
    return Case(_f64(TimeMajorAttention()), _x(3, 4, 8), probe_loss)


def custom_time_major_transformer_T_eq_B():
    # caught by the self-check only
    torch.manual_seed(0)
    return Case(_f64(TimeMajorAttention()), _x(3, 3, 8), probe_loss)


class Permuted(nn.Module):
    """The samples are shuffled (cyclically: no fixed point) between two layers."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(torch.roll(h, 1, 0))


def custom_samples_permuted_in_forward():
    # caught by the self-check only
    torch.manual_seed(0)
    return Case(_f64(Permuted()), _x(3, 4), probe_loss)


class PermutedBack(nn.Module):
    """Shuffled, processed, and put back in order: every output row is its own sample's."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x):
        perm = torch.tensor([2, 0, 3, 1])[: x.shape[0]] if x.shape[0] == 4 else torch.arange(x.shape[0])
        h = self.a(x[perm])
        return self.b(torch.tanh(h))[torch.argsort(perm)]


def custom_samples_permuted_and_restored():
    # each layer sees a permuted batch: rows and samples no longer line up inside the layer
    # caught by the self-check only
    torch.manual_seed(0)
    return Case(_f64(PermutedBack()), _x(4, 4), probe_loss)


class BatchMean(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = self.a(x)
        return self.b(torch.tanh(h - h.mean(0, keepdim=True)))  # mixes the samples


def custom_mean_over_batch():
    # caught by the self-check only
    torch.manual_seed(0)
    return Case(_f64(BatchMean()), _x(3, 4), probe_loss)


class WSConv(nn.Conv2d):
    def _conv_forward(self, x, weight, bias):
        w = weight - weight.mean((1, 2, 3), keepdim=True)
        return super()._conv_forward(x, w / (w.std((1, 2, 3), keepdim=True) + 1e-5), bias)


def custom_conv_subclass_conv_forward():
    torch.manual_seed(0)
    return Case(_f64(Head(WSConv(2, 3, 3, padding=1))), _x(3, 2, 5, 5), probe_loss)


def custom_instance_forward_replaced():
    torch.manual_seed(0)
    m = _f64(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)))
    lin = m[2]
    lin.forward = lambda x: F.linear(x, 2.0 * lin.weight, lin.bias)
    return Case(m, _x(3, 4), probe_loss)


class ForeignWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h @ self.a.weight)  # a's weight used in the root's forward too


def custom_parameter_used_in_another_forward():
    torch.manual_seed(0)
    return Case(_f64(ForeignWeight()), _x(3, 4), probe_loss, backwards=("loss", "hooks"))


class SharedConv(nn.Module):
    """Two convolutions with one weight (different stride and dilation), and two LayerNorms with one bias."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 3, 3, padding=1)
        self.c2 = nn.Conv2d(3, 3, 3, stride=2, dilation=2, padding=2)
        self.c2.weight = self.c1.weight
        self.n1, self.n2 = nn.LayerNorm(3), nn.LayerNorm(3)
        self.n2.bias = self.n1.bias

    def forward(self, x):
        h = self.n1(torch.tanh(self.c1(x)).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.n2(self.c2(h).permute(0, 2, 3, 1))


def custom_weight_sharing_across_modules():
    torch.manual_seed(0)
    return Case(_f64(SharedConv()), _x(3, 3, 6, 6), probe_loss)


class MHA(nn.Module):
    def __init__(self, batch_first, kdim=None):
        super().__init__()
        self.batch_first = batch_first
        self.att = nn.MultiheadAttention(8, 2, batch_first=batch_first, kdim=kdim, vdim=kdim)
        self.kv = nn.Linear(8, kdim or 8)

    def forward(self, x):
        kv = self.kv(x)
        if not self.batch_first:
            x, kv = x.transpose(0, 1), kv.transpose(0, 1)
        out = self.att(x, kv, kv, need_weights=False)[0]
        return out if self.batch_first else out.transpose(0, 1)


def custom_mha_batch_first():
    torch.manual_seed(0)
    return Case(_f64(MHA(True)), _x(3, 4, 8), probe_loss)


def custom_mha_seq_first():
    torch.manual_seed(0)
    return Case(_f64(MHA(False)), _x(3, 4, 8), probe_loss)


def custom_mha_only_out_proj_trainable():
    # out_proj.weight is used functionally by F.multi_head_attention_forward, the Linear never runs
    torch.manual_seed(0)
    m = _f64(MHA(True))
    for n, p in m.named_parameters():
        p.requires_grad_(n.startswith("att.out_proj") or n.startswith("kv"))
    return Case(m, _x(3, 4, 8), probe_loss, backwards=("loss", "hooks"))


def custom_transformer_encoder_layers():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, norm_first=True)
    return Case(_f64(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)), _x(3, 4, 8), probe_loss)


class CallsTwice(nn.Module):
    """A LayerNorm and an Embedding each called twice, once on shifted inputs."""

    def __init__(self):
        super().__init__()
        self.e, self.n, self.o = nn.Embedding(9, 4), nn.LayerNorm(4), nn.Linear(4, 3)

    def forward(self, ids):
        h = self.n(self.e(ids)) + self.n(torch.tanh(self.e((ids + 1) % 9)))
        return self.o(h)


def custom_submodule_called_twice():
    r = _rng("called-twice")
    torch.manual_seed(0)
    return Case(_f64(CallsTwice()), _ids(r.randint(2, 4), r.randint(3, 7), 9), probe_loss)


class InplaceActivations(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 5), nn.Linear(5, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = self.a(x)
        h += 1.0  # in place on a layer's output
        h = F.gelu(h)
        g = self.b(h)
        g.mul_(0.5).tanh_()  # in place, twice, on another output
        return self.c(g)


def custom_inplace_ops_on_activations():
    torch.manual_seed(0)
    return Case(_f64(InplaceActivations()), _x(3, 4), probe_loss, backwards=("loss", "hooks"))


class InplaceSliceAssign(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.n, self.b = nn.Linear(4, 5), nn.LayerNorm(5), nn.Linear(5, 3)

    def forward(self, x):
        h = self.a(x)
        h[:, 0] = 0.0  # slice assignment on a layer's output
        h = self.n(h)
        h[..., 1:3] *= 2.0  # and on a LayerNorm's output
        F.relu(h, inplace=True)
        return self.b(h)


def custom_inplace_slice_assignment():
    torch.manual_seed(0)
    return Case(_f64(InplaceSliceAssign()), _x(3, 2, 4), probe_loss, backwards=("loss", "hooks"))


class PartlyDetached(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h.detach()) + self.c(h)  # a gets gradient only through c


def custom_detach_on_part_of_the_path():
    torch.manual_seed(0)
    return Case(_f64(PartlyDetached()), _x(3, 4), probe_loss)


class LooseScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.a(x) * self.scale


def custom_loose_parameter():
    torch.manual_seed(0)
    return Case(_f64(LooseScale()), _x(3, 4), probe_loss)


def custom_parameter_used_in_the_loss():
    # loss.backward(): dpzoo sees only the model's outputs, so the loss's use of 0.weight is missed
    # (hooks.backward(loss) refuses; dpzoo's engine sees the stray weight gradient). dpzoo.verify
    # catches it: the per-sample gradients do not sum to the loss's batch gradient
    torch.manual_seed(0)
    m = _f64(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)))
    return Case(
        m,
        _x(3, 4),
        lambda out: probe_loss(out) + (out[:, :3] @ m[0].weight[:3, :3]).pow(2).sum(),
        backwards=("loss", "hooks"),
    )


class EinsumParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.W = nn.Parameter(torch.randn(4, 4))
        self.a = nn.Linear(4, 3)

    def forward(self, x):
        return self.a(torch.einsum("btd,de->bte", x, self.W))


class BmmForeign(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        w = self.b.weight.t().unsqueeze(0).expand(x.shape[0], -1, -1)
        return torch.bmm(torch.tanh(self.a(x)), w)  # b's weight by bmm, b never called


def custom_einsum_with_a_parameter():
    torch.manual_seed(0)
    return Case(_f64(EinsumParam()), _x(3, 5, 4), probe_loss)


def custom_bmm_with_another_modules_weight():
    torch.manual_seed(0)
    return Case(_f64(BmmForeign()), _x(3, 5, 4), probe_loss, backwards=("loss", "hooks"))


class FunctionalConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(2, 3, 3), nn.Linear(3, 2)

    def forward(self, x):
        h = F.conv2d(x, self.conv.weight, self.conv.bias, padding=1)  # the module is never called
        return self.head(h.mean((2, 3)))


def custom_functional_conv_with_module_weight():
    torch.manual_seed(0)
    return Case(_f64(FunctionalConv()), _x(3, 2, 5, 5), probe_loss, backwards=("loss", "hooks"))


class Checkpointed(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant
        self.c, self.n, self.e, self.o = (
            nn.Conv1d(4, 4, 3, padding=1),
            nn.GroupNorm(2, 4),
            nn.Embedding(7, 4),
            nn.Linear(4, 3),
        )

    def block(self, h, ids):
        return torch.tanh(self.n(self.c(h))) + self.e(ids).transpose(1, 2)

    def forward(self, x, ids):
        h = checkpoint(self.block, x, ids, use_reentrant=self.reentrant)
        return self.o(h.transpose(1, 2))


def custom_gradient_checkpointing_nonreentrant():
    torch.manual_seed(0)
    return Case(_f64(Checkpointed(False)), (_x(3, 4, 5), _ids(3, 5, 7)), probe_loss, backwards=("loss", "hooks"))


def custom_gradient_checkpointing_reentrant():
    torch.manual_seed(0)
    return Case(_f64(Checkpointed(True)), (_x(3, 4, 5), _ids(3, 5, 7)), probe_loss)


class DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 5), nn.Linear(5, 3), nn.Linear(5, 2)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return {"logits": self.b(h), "aux": (self.c(h), "not a tensor", None), "ids": x.argmax(-1)}


def custom_model_returning_dict_and_tuple():
    torch.manual_seed(0)
    return Case(_f64(DictOut()), _x(3, 4), probe_loss)


class PadEmb(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(8, 4, padding_idx=-1)  # the last row, written as -1
        self.o = nn.Linear(4, 3)

    def forward(self, ids):
        return self.o(torch.tanh(self.e(ids)))


def custom_embedding_negative_padding_idx():
    torch.manual_seed(0)
    ids = _ids(3, 6, 8)
    ids[0, :3] = 7
    ids[2, -1] = 7
    return Case(_f64(PadEmb()), ids, probe_loss)


def _norm_model(norm, c=4):
    return nn.Sequential(nn.Conv2d(2, c, 3, padding=1), norm, nn.Tanh(), nn.Flatten(), nn.LazyLinear(3))


def _norm_case(norm, train=True, b=3):
    torch.manual_seed(0)
    m = _norm_model(norm)
    m(torch.zeros(1, 2, 4, 4))  # materialise the LazyLinear
    return Case(_f64(m, train=train), _x(b, 2, 4, 4), probe_loss)


def custom_batchnorm_non_affine_train():
    # no parameter, so nothing to refuse at attach; batch statistics mix the samples.
    # refused at every forward by the hooks (batch statistics); dpzoo.verify's train-mode probe too
    return _norm_case(nn.BatchNorm2d(4, affine=False))


def custom_batchnorm_non_affine_eval():
    return _norm_case(nn.BatchNorm2d(4, affine=False), train=False)


def custom_instancenorm_running_stats():
    return _norm_case(nn.InstanceNorm2d(4, affine=False, track_running_stats=True))


def custom_instancenorm_affine():
    return _norm_case(nn.InstanceNorm2d(4, affine=True))


def custom_groupnorm_one_group():
    return _norm_case(nn.GroupNorm(1, 4))


def custom_layernorm_without_bias():
    r = _rng("layernorm-no-bias")
    d, h = r.randint(2, 6), r.randint(2, 8)
    torch.manual_seed(0)
    return Case(
        _f64(nn.Sequential(nn.Linear(d, h), nn.LayerNorm(h, bias=False), nn.Linear(h, 2))),
        _x(r.randint(2, 4), r.randint(1, 6), d),
        probe_loss,
    )


def custom_conv_groups_dilation_circular():
    r = _rng("conv-groups")
    torch.manual_seed(0)
    conv = nn.Conv2d(6, 9, (3, 2), stride=(2, 1), dilation=(1, 2), groups=3, padding=(2, 1), padding_mode="circular")
    return Case(_f64(Head(conv)), _x(3, 6, r.randint(6, 8), r.randint(5, 7)), probe_loss)


def custom_conv3d():
    r = _rng("conv3d")
    torch.manual_seed(0)
    return Case(
        _f64(nn.Sequential(nn.Conv3d(2, 3, 2, stride=(1, 2, 1), padding=1), nn.Tanh(), nn.Conv3d(3, 2, 1))),
        _x(r.randint(2, 3), 2, *(r.randint(2, 5) for _ in range(3))),
        probe_loss,
    )


def custom_conv_transpose2d():
    torch.manual_seed(0)
    return Case(_f64(Head(nn.ConvTranspose2d(2, 3, 3, stride=2))), _x(3, 2, 3, 3), probe_loss)


def custom_linear_on_4d_inputs():
    r = _rng("linear-4d")
    torch.manual_seed(0)
    return Case(
        _f64(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))),
        _x(r.randint(2, 4), r.randint(1, 3), r.randint(1, 4), 4),
        probe_loss,
    )


def custom_bias_only_training():
    torch.manual_seed(0)
    m = nn.Sequential(
        nn.Conv2d(2, 4, 3),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.Flatten(1),
        nn.Linear(36, 5),
        nn.LayerNorm(5),
        nn.Linear(5, 3),
    )
    m = _f64(m)
    for n, p in m.named_parameters():
        p.requires_grad_(n.endswith("bias"))
    return Case(m, _x(3, 2, 5, 5), probe_loss, backwards=("loss", "hooks"))


class HookScaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)
        self.a.register_forward_hook(lambda mod, args, out: out * 2.0)  # rewrites a's output

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def custom_forward_hook_rewrites_output():
    # a user's forward hook registered before dpzoo's: dpzoo's hook runs first anyway (prepend)
    torch.manual_seed(0)
    return Case(_f64(HookScaled()), _x(3, 4), probe_loss)


def custom_weight_norm_parametrization():
    torch.manual_seed(0)
    m = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(4, 5)), nn.Tanh(), nn.Linear(5, 3))
    return Case(_f64(m), _x(3, 4), probe_loss)


class FunctionalCall(nn.Module):
    """Runs its inner network with transformed parameters (torch.func.functional_call)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))

    def forward(self, x):
        params = {n: 2.0 * p for n, p in self.net.named_parameters()}
        return torch.func.functional_call(self.net, params, (x,))


def custom_functional_call_with_transformed_parameters():
    # the hooked Linear's weight is 2·θ, not θ: its rule gives ∂L/∂(2θ)
    # caught by the self-check only
    torch.manual_seed(0)
    return Case(_f64(FunctionalCall()), _x(3, 4), probe_loss, backwards=("loss", "hooks"))


class FunctionalCallTransposed(nn.Module):
    """functional_call with a square weight transposed: every per-sample norm is unchanged (‖Wᵀ‖ = ‖W‖),
    only the clipped sum (the update) is wrong."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))

    def forward(self, x):
        params = dict(self.net.named_parameters())
        params["0.weight"] = params["0.weight"].t()
        return torch.func.functional_call(self.net, params, (x,))


def custom_functional_call_transposed_square_weight():
    # the hooks refuse swapped parameters; the self-check's sum check would catch the transposed
    # per-sample gradient too (an isometry: norms right, update wrong)
    torch.manual_seed(0)
    return Case(_f64(FunctionalCallTransposed()), _x(3, 4), probe_loss, backwards=("loss", "hooks"))


class HookPermuted(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)
        self.a.register_forward_hook(lambda mod, args, out: out.flip(-1))  # permutes a's output features

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def custom_forward_hook_permutes_output_features():
    # dpzoo's hook runs before the user's (prepend): it records the layer's own output, exact
    torch.manual_seed(0)
    return Case(_f64(HookPermuted()), _x(3, 4), probe_loss)


class TrainOnlyMixup(nn.Module):
    """Mixup inside forward, in training only: every row mixes two samples."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x):
        if self.training:
            x = 0.7 * x + 0.3 * x.flip(0)
        return self.b(torch.tanh(self.a(x)))


def custom_train_only_mixup():
    # caught by the self-check's train-mode probe (same random state, one sample replaced)
    torch.manual_seed(0)
    return Case(_f64(TrainOnlyMixup()), _x(3, 4), probe_loss)


class LearnedQueries(nn.Module):
    """Learned queries looked up with (1, Q) ids and taken as [0] (shared by every sample)."""

    def __init__(self):
        super().__init__()
        self.queries, self.k = nn.Embedding(3, 4), nn.Linear(4, 4)

    def forward(self, x):
        q = self.queries(torch.arange(3).unsqueeze(0))[0]  # (Q, d)
        return torch.einsum("qd,btd->bqt", q, self.k(x))


def custom_embedding_batch1_ids_indexed():
    # caught by the self-check only
    torch.manual_seed(0)
    return Case(_f64(LearnedQueries()), _x(3, 5, 4), probe_loss)


class Siamese(nn.Module):
    """Both views through one encoder, concatenated along the batch (2B rows)."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(4, 5)

    def forward(self, a, b):
        h = self.enc(torch.cat([a, b]))
        ha, hb = h.chunk(2)
        return ha * hb


def custom_siamese_concatenated_views():
    torch.manual_seed(0)
    return Case(_f64(Siamese()), (_x(3, 4), _x(3, 4, seed=2)), probe_loss)


class UnusedBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.unused = nn.Linear(4, 4), nn.Linear(4, 3), nn.Linear(4, 4)

    def forward(self, x, use_b=True):
        h = torch.tanh(self.a(x))
        return self.b(h) if use_b else h[:, :3]


def custom_embedding_max_norm():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Embedding(8, 4, max_norm=1.0), nn.Linear(4, 3))
    return Case(_f64(m), _ids(3, 5, 8), probe_loss)


def custom_groupnorm_on_2d_input():
    r = _rng("groupnorm-2d")
    g = r.randint(1, 3)
    torch.manual_seed(0)
    return Case(
        _f64(nn.Sequential(nn.Linear(4, 2 * g), nn.GroupNorm(g, 2 * g), nn.Tanh(), nn.Linear(2 * g, 2))),
        _x(r.randint(2, 4), 4),
        probe_loss,
    )


def timm_efficientnet_gn_bias_only():
    # GroupNormAct's bias on the activation-free path: the gradient at its activation's input
    case = timm_efficientnet_gn()
    for n, p in case.model.named_parameters():
        p.requires_grad_(n.endswith("bias"))
    case.backwards = ("loss", "hooks")
    return case


class _SignSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.sign(x)

    @staticmethod
    def backward(ctx, g):
        return g  # straight-through


class _BatchGradNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g / g.norm()  # normalises the gradient over the whole batch: mixes the samples


class CustomFunctions(nn.Module):
    def __init__(self, mixing):
        super().__init__()
        self.mixing = mixing
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = _SignSTE.apply(self.a(x)) + torch.tanh(self.a(x))
        if self.mixing:
            h = _BatchGradNorm.apply(h)
        return self.b(h)


def custom_straight_through_estimator():
    torch.manual_seed(0)
    return Case(_f64(CustomFunctions(False)), _x(3, 4), probe_loss)


def custom_autograd_function_mixing_gradients():
    # caught by the self-check only
    torch.manual_seed(0)
    return Case(_f64(CustomFunctions(True)), _x(3, 4), probe_loss)


def custom_backward_pre_hook_scales_grad():
    # a user's full backward pre-hook rewrites b's output gradient; autograd uses it for b's weight too
    torch.manual_seed(0)
    m = _f64(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)))
    m[2].register_full_backward_pre_hook(lambda mod, go: (go[0] * torch.tensor([1.0, -2.0, 0.5], dtype=F64),))
    return Case(m, _x(3, 4), probe_loss)


class VmapPerSample(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = torch.func.vmap(lambda row: torch.tanh(self.a(row)))(x)  # the Linear sees one unbatched row
        return self.b(h)


def custom_vmap_over_samples():
    torch.manual_seed(0)
    return Case(_f64(VmapPerSample()), _x(3, 4), probe_loss)


class LoRALinear(nn.Module):
    """A frozen Linear plus a trainable low-rank update B·A (LoRA), as peft builds it."""

    def __init__(self, base, r=2):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)

    def forward(self, x):
        return self.base(x) + 0.5 * self.lora_B(self.lora_A(x))


def hf_llama_lora():
    case = hf_llama_causal_lm()
    m = case.model
    for p in m.parameters():
        p.requires_grad_(False)
    for layer in m.model.layers:
        attn = layer.self_attn
        attn.q_proj, attn.v_proj = LoRALinear(attn.q_proj).to(F64), LoRALinear(attn.v_proj).to(F64)
    _perturb(m, seed=1)
    return case


def opacus_dplstm():
    from opacus.layers import DPLSTM

    class Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.head = DPLSTM(4, 5, batch_first=True), nn.Linear(5, 2)

        def forward(self, x):
            return self.head(self.rnn(x)[0])

    torch.manual_seed(0)
    return Case(_f64(Seq()), _x(3, 4, 4), probe_loss)


class OpacusMHA(nn.Module):
    def __init__(self, batch_first):
        super().__init__()
        from opacus.layers import DPMultiheadAttention

        self.batch_first = batch_first
        self.att = DPMultiheadAttention(8, 2, batch_first=batch_first)

    def forward(self, x):  # batch-first in and out
        if not self.batch_first:
            x = x.transpose(0, 1)
        out = self.att(x, x, x, need_weights=False)[0]
        return out if self.batch_first else out.transpose(0, 1)


def opacus_dp_mha_batch_first():
    torch.manual_seed(0)
    return Case(_f64(OpacusMHA(True)), _x(3, 4, 8), probe_loss)


def opacus_dp_mha_seq_first_T_eq_B():
    # caught by the self-check only
    torch.manual_seed(0)
    return Case(_f64(OpacusMHA(False)), _x(3, 3, 8), probe_loss)


def timm_groupnormact_no_act_bias_only():
    from timm.layers.norm_act import GroupNormAct

    torch.manual_seed(0)
    m = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        GroupNormAct(4, num_groups=2, apply_act=False),
        nn.Tanh(),
        GroupNormAct(4, num_groups=1, act_layer=nn.GELU),
        nn.Conv2d(4, 2, 1),
    )
    m = _f64(m)
    for n, p in m.named_parameters():
        p.requires_grad_(n.endswith("bias"))
    return Case(m, _x(3, 2, 4, 4), probe_loss, backwards=("loss", "hooks"))


def timm_groupnormact_random_activation():
    # the GroupNormAct rule recomputes act(GN(x)) to pull the gradient back: RReLU's random slopes in
    # training would be redrawn (silently wrong before; refused at attach now)
    from timm.layers.norm_act import GroupNormAct

    torch.manual_seed(0)
    m = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        GroupNormAct(4, num_groups=2, act_layer=nn.RReLU, inplace=False),
        nn.Conv2d(4, 2, 1),
    )
    return Case(_f64(m), _x(3, 2, 4, 4), probe_loss)


def custom_sample_dependent_control_flow():
    # a layer that runs, a layer never called: zero per-sample gradients for it
    torch.manual_seed(0)
    return Case(_f64(UnusedBranch()), _x(3, 4), probe_loss)


# =============================================================================================
# the corpus: id -> (expected outcome, factory)
# =============================================================================================

EXACT, REFUSED = "exact", "refused"

CASES: dict[str, tuple[str, Callable[[], Case]]] = {
    # --- timm ---
    "timm/convnext-layerscale-gamma": (REFUSED, timm_convnext_layerscale),  # gamma: a loose (C,) parameter
    "timm/convnext-layerscale-dp-ready": (EXACT, timm_convnext_layerscale_dp_ready),  # γ moved into LayerScale
    "timm/convnext-conv-mlp-layerscale-dp-ready": (EXACT, timm_convnext_conv_mlp_layerscale_dp_ready),
    "timm/convnext-no-layerscale": (EXACT, timm_convnext_no_layerscale),  # LayerNorm2d, depthwise conv
    "timm/convnext-conv-mlp": (EXACT, timm_convnext_conv_mlp),
    "timm/mobilenetv3-batchnorm": (REFUSED, timm_mobilenetv3_bn),  # BatchNorm mixes samples
    "timm/mobilenetv3-make_dp_ready": (EXACT, timm_mobilenetv3_dp_ready),
    "timm/efficientnet-batchnorm": (REFUSED, timm_efficientnet_bn),
    "timm/efficientnet-make_dp_ready": (EXACT, timm_efficientnet_dp_ready),
    "timm/efficientnet-groupnormact-inplace": (REFUSED, timm_efficientnet_gn_inplace),
    "timm/efficientnet-groupnormact": (EXACT, timm_efficientnet_gn),
    "timm/efficientnet-groupnormact-bias-only": (EXACT, timm_efficientnet_gn_bias_only),
    "timm/groupnormact-no-act-bias-only": (EXACT, timm_groupnormact_no_act_bias_only),
    "timm/groupnormact-random-activation": (REFUSED, timm_groupnormact_random_activation),
    "timm/efficientnet-evonorm": (REFUSED, timm_efficientnet_evonorm),
    "timm/efficientnet-conv2dsame-make_dp_ready": (EXACT, timm_efficientnet_same_padding_dp_ready),
    "timm/vit-reg-tokens-layerscale-qknorm": (EXACT, timm_vit_reg_tokens_token_pool_layerscale_qknorm),
    "timm/vit-map-pool-reg-token-cls": (EXACT, timm_vit_map_pool_reg_tokens_cls),
    "timm/vit-dynamic-img-size": (REFUSED, timm_vit_dynamic_img_size),
    "timm/deit-distilled-token": (REFUSED, timm_deit_distilled),
    "timm/resnetv2-bit-stdconv-groupnormact": (EXACT, timm_resnetv2_bit_stdconv),
    "timm/nfnet-scaled-stdconv": (EXACT, timm_nfnet_scaled_stdconv),
    "timm/regnet-batchnorm": (REFUSED, timm_regnet_bn),
    "timm/regnet-make_dp_ready": (EXACT, timm_regnet_dp_ready),
    "timm/resnet-make_dp_ready": (EXACT, timm_resnet_dp_ready),
    "timm/mlp-mixer": (EXACT, timm_mixer),
    "timm/resmlp-affine": (REFUSED, timm_resmlp_affine),
    "timm/poolformerv2-scale": (REFUSED, timm_poolformer),
    "timm/swin-relative-position-bias": (REFUSED, timm_swin_relative_position_bias),
    "timm/eva02-rope": (REFUSED, timm_eva),
    # --- Hugging Face ---
    "hf/bert-seqcls-token-types-mask": (EXACT, hf_bert_sequence_classification),
    "hf/distilbert-mlm-tied": (EXACT, hf_distilbert_masked_lm_tied),
    "hf/roberta-seqcls-padding-positions": (EXACT, hf_roberta_padding_idx_positions),
    "hf/roberta-mlm-tied-head-bias": (REFUSED, hf_roberta_mlm_head_bias),
    "hf/gpt2-seqcls-last-token": (EXACT, hf_gpt2_sequence_classification),
    "hf/gpt2-labels-mean-loss": (REFUSED, hf_gpt2_labels_mean_loss),  # caught by the self-check only
    "hf/opt-learned-positions": (REFUSED, hf_opt_learned_positions),
    "hf/llama-causal-lm": (EXACT, hf_llama_causal_lm),
    "hf/llama-gradient-checkpointing": (EXACT, hf_llama_gradient_checkpointing),
    "hf/t5-relative-bias-T-ne-B": (REFUSED, hf_t5_T_ne_B),
    "hf/t5-relative-bias-T-eq-B": (REFUSED, hf_t5_T_eq_B),
    "hf/t5-relative-bias-frozen-T-eq-B": (EXACT, hf_t5_relative_bias_frozen_T_eq_B),
    "hf/t5-decoder-length-1": (REFUSED, hf_t5_decoder_length_1),
    "hf/bart-learned-positions": (REFUSED, hf_bart_learned_positions),
    "hf/vit-cls-token": (EXACT, hf_vit),  # cls_token, position_embeddings: loose tensors
    "hf/clip-text-position-embeddings": (EXACT, hf_clip_text_position_embeddings),
    "hf/albert-shared-layers": (EXACT, hf_albert_shared_layers),
    "hf/convnext-layerscale": (REFUSED, hf_convnext),
    "hf/llama-lora-adapters": (EXACT, hf_llama_lora),
    # --- Opacus' DP layers ---
    # DPLSTM re-registers its cells' RNNLinear parameters under torch's names (weight_ih_l0, ...): the same
    # tensors, owned twice; the owner without a rule refuses (safe, if needlessly)
    "opacus/dplstm-renamed-parameters": (REFUSED, opacus_dplstm),
    "opacus/dp-mha-batch-first": (EXACT, opacus_dp_mha_batch_first),
    "opacus/dp-mha-seq-first-T-eq-B": (REFUSED, opacus_dp_mha_seq_first_T_eq_B),  # caught by the self-check only
    # --- custom modules ---
    "custom/time-major-rnn-T-ne-B": (REFUSED, custom_time_major_rnn_T_ne_B),
    "custom/time-major-rnn-T-eq-B": (REFUSED, custom_time_major_rnn_T_eq_B),  # caught by the self-check only
    "custom/torch-gru-time-major": (REFUSED, custom_torch_gru_time_major),
    "custom/dpzoo-lstm": (EXACT, custom_dpzoo_lstm_batch_first),
    "custom/time-major-transformer-T-ne-B": (REFUSED, custom_time_major_transformer_T_ne_B),
    "custom/time-major-transformer-T-eq-B": (REFUSED, custom_time_major_transformer_T_eq_B),  # self-check only
    "custom/samples-permuted": (REFUSED, custom_samples_permuted_in_forward),  # caught by the self-check only
    "custom/samples-permuted-and-restored": (REFUSED, custom_samples_permuted_and_restored),  # self-check only
    "custom/mean-over-batch": (REFUSED, custom_mean_over_batch),  # caught by the self-check only
    "custom/conv-subclass-_conv_forward": (REFUSED, custom_conv_subclass_conv_forward),
    "custom/instance-forward-replaced": (REFUSED, custom_instance_forward_replaced),
    "custom/parameter-in-another-forward": (REFUSED, custom_parameter_used_in_another_forward),
    "custom/weight-sharing-across-modules": (EXACT, custom_weight_sharing_across_modules),
    "custom/mha-batch-first": (REFUSED, custom_mha_batch_first),
    "custom/mha-seq-first": (REFUSED, custom_mha_seq_first),
    "custom/mha-only-out-proj-trainable": (REFUSED, custom_mha_only_out_proj_trainable),
    "custom/transformer-encoder-layers": (REFUSED, custom_transformer_encoder_layers),
    "custom/submodule-called-twice": (EXACT, custom_submodule_called_twice),
    "custom/inplace-ops-on-activations": (EXACT, custom_inplace_ops_on_activations),
    "custom/inplace-slice-assignment": (EXACT, custom_inplace_slice_assignment),
    "custom/detach-part-of-path": (EXACT, custom_detach_on_part_of_the_path),
    "custom/loose-parameter": (REFUSED, custom_loose_parameter),
    "custom/parameter-in-the-loss": (REFUSED, custom_parameter_used_in_the_loss),  # the self-check's sum check
    "custom/einsum-with-parameter": (REFUSED, custom_einsum_with_a_parameter),
    "custom/bmm-with-another-modules-weight": (REFUSED, custom_bmm_with_another_modules_weight),
    "custom/functional-conv-with-module-weight": (REFUSED, custom_functional_conv_with_module_weight),
    "custom/checkpoint-nonreentrant": (EXACT, custom_gradient_checkpointing_nonreentrant),
    "custom/checkpoint-reentrant": (EXACT, custom_gradient_checkpointing_reentrant),
    "custom/dict-and-tuple-output": (EXACT, custom_model_returning_dict_and_tuple),
    "custom/embedding-negative-padding-idx": (EXACT, custom_embedding_negative_padding_idx),
    "custom/batchnorm-non-affine-train": (REFUSED, custom_batchnorm_non_affine_train),
    "custom/batchnorm-non-affine-eval": (EXACT, custom_batchnorm_non_affine_eval),
    "custom/instancenorm-running-stats": (EXACT, custom_instancenorm_running_stats),
    "custom/instancenorm-affine": (EXACT, custom_instancenorm_affine),
    "custom/groupnorm-one-group": (EXACT, custom_groupnorm_one_group),
    "custom/layernorm-no-bias": (EXACT, custom_layernorm_without_bias),
    "custom/conv-groups-dilation-circular": (EXACT, custom_conv_groups_dilation_circular),
    "custom/conv3d": (EXACT, custom_conv3d),
    "custom/conv-transpose2d": (EXACT, custom_conv_transpose2d),
    "custom/linear-on-4d": (EXACT, custom_linear_on_4d_inputs),
    "custom/bias-only": (EXACT, custom_bias_only_training),
    # dpzoo's layer hook runs first (prepend), so a user's hook that edits the output is part of
    # the graph behind the recorded output: exact
    "custom/forward-hook-rewrites-output": (EXACT, custom_forward_hook_rewrites_output),
    "custom/weight-norm-parametrization": (REFUSED, custom_weight_norm_parametrization),
    "custom/functional-call-transformed-params": (REFUSED, custom_functional_call_with_transformed_parameters),
    "custom/embedding-batch1-ids-indexed": (REFUSED, custom_embedding_batch1_ids_indexed),  # self-check only
    "custom/functional-call-transposed-weight": (REFUSED, custom_functional_call_transposed_square_weight),
    "custom/forward-hook-permutes-features": (EXACT, custom_forward_hook_permutes_output_features),
    "custom/train-only-mixup": (REFUSED, custom_train_only_mixup),  # the self-check's train-mode probe
    "custom/siamese-concatenated-views": (REFUSED, custom_siamese_concatenated_views),
    "custom/unused-branch": (EXACT, custom_sample_dependent_control_flow),
    "custom/embedding-max-norm": (REFUSED, custom_embedding_max_norm),
    "custom/groupnorm-on-2d-input": (EXACT, custom_groupnorm_on_2d_input),
    "custom/straight-through-estimator": (EXACT, custom_straight_through_estimator),
    "custom/autograd-function-mixing-grads": (REFUSED, custom_autograd_function_mixing_gradients),  # self-check
    "custom/backward-pre-hook-scales-grad": (EXACT, custom_backward_pre_hook_scales_grad),
    "custom/vmap-over-samples": (REFUSED, custom_vmap_over_samples),
}

SLOW = {
    "timm/mobilenetv3-make_dp_ready",
    "timm/efficientnet-make_dp_ready",
    "timm/efficientnet-conv2dsame-make_dp_ready",
    "timm/convnext-conv-mlp",
}


def _params():
    return [pytest.param(k, id=k, marks=[pytest.mark.slow] if k in SLOW else []) for k in CASES]


@pytest.mark.parametrize("case_id", _params())
def test_corpus_case(case_id):
    expect, make = CASES[case_id]
    outcome, detail = run_case(make())
    if outcome == "WRONG":
        hint = "" if hasattr(dpzoo, "verify") else " (dpzoo.verify is missing: nothing catches it yet)"
        pytest.fail(f"{case_id}: SILENTLY WRONG{hint}: {detail}")
    got = EXACT if outcome == "exact" else REFUSED
    assert got == expect, f"{case_id}: expected {expect}, got {outcome}: {detail}"


def test_corpus_size():
    assert len(CASES) >= 45


if __name__ == "__main__":  # the table of outcomes
    import sys
    import time
    import warnings

    warnings.simplefilter("ignore")
    only = sys.argv[1:]
    for k, (expect, make) in CASES.items():
        if only and not any(o in k for o in only):
            continue
        t0, c0 = time.time(), time.process_time()
        try:
            outcome, detail = run_case(make())
        except Exception as e:  # noqa: BLE001
            outcome, detail = "ERROR", f"{type(e).__name__}: {e}"
        ok = (outcome == "exact") == (expect == EXACT) and outcome not in ("WRONG", "ERROR")
        print(
            f"{'ok ' if ok else 'BAD'} {k:50s} {expect:8s} {outcome:18s} {time.time() - t0:5.1f}s "
            f"(cpu {time.process_time() - c0:5.1f}s)  {detail[:160]}"
        )
