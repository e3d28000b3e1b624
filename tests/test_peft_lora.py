"""DP-LoRA with PEFT: per-sample norms and clipped sums of LoRA adapters against a loop of
per-sample backward passes (GPT-2's Conv1D and tied embeddings, LLaMA with biases, a BERT
classifier with modules_to_save, a ViT with convolution LoRA, a plain Hugging Face model) in
every hook mode, LoRA dropout in train mode, one DP step through the engine against the DP-SGD
formula, mode="lora" and LoRA + DP-BiTFiT, dpzoo.integrations.peft.dp_lora, and the refusals."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from dp_reference import clip_weights, seeded_noise
from grad_reference import assert_close, check_against_brute_force, per_sample_grads, zoo_model_and_inputs
from torch.utils.data import DataLoader, TensorDataset

import dpzoo
from dpzoo.errors import InvalidArgumentError, PrivacyUsageError, SaveError, UnsupportedModuleError
from dpzoo.grad_norms import attach_norm_hooks
from dpzoo.integrations.peft import (
    data_driven_inits,
    declare_public_init,
    default_target_modules,
    dp_lora,
    is_peft_model,
    lora_parameters,
    lora_trainable,
    unsupported_lora_layers,
)
from dpzoo.privacy.modes import MODES, TRAINING_MODES, apply_mode, mode_trainable

peft = pytest.importorskip("peft")

HOOK_MODES = ["auto", "ghost", "instantiate"]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():  # PEFT's notes on fan_in_fan_out and tied layers
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)
        yield


def _peft_model(name, seed=0, **config):
    """A zoo entry's small float64 configuration wrapped in LoRA; B is random (PEFT's default zero
    B would make every lora_A gradient zero), so both factors get non-trivial per-sample gradients."""
    model, inputs, loss_fn = zoo_model_and_inputs(name, seed=seed)
    torch.manual_seed(seed + 7)
    config = {"r": 4, "lora_alpha": 8, "init_lora_weights": False, **copy.deepcopy(config)}  # PEFT edits lists
    model = peft.get_peft_model(model, peft.LoraConfig(**config)).double()
    return model, inputs, loss_fn


def _trainable(model):
    return {n for n, p in model.named_parameters() if p.requires_grad}


CASES = {
    # Conv1D base layers (fan_in_fan_out) and the lm_head tied to the frozen wte
    "gpt2-conv1d-tied-lm-head": ("gpt2", dict(target_modules=["c_attn", "c_proj", "c_fc", "lm_head"])),
    # PEFT's trained copies of the tied wte / lm_head, tied to each other: Phantom Clipping's case
    "gpt2-trained-tied-copies": (
        "gpt2",
        dict(target_modules=["c_attn"], modules_to_save=["wte", "lm_head"], ensure_weight_tying=True),
    ),
    # LoRA + DP-BiTFiT through PEFT's bias="all", and a bias on lora_B
    "llama-tiny-bias-lora-bitfit": (
        "llama-tiny-bias",
        dict(target_modules=["q_proj", "v_proj", "o_proj", "down_proj"], bias="all", lora_bias=True),
    ),
    "bert-seq-cls-modules-to-save": ("bert-base", dict(task_type="SEQ_CLS", target_modules=["query", "value"])),
    # LoRA on the patch embedding's Conv2d (lora_A a strided conv, lora_B a 1x1 conv) and on Linear layers
    "vit-conv-and-linear": (
        "vit-tiny-patch16",
        dict(target_modules=["qkv", "fc1", "patch_embed.proj"], modules_to_save=["head"]),
    ),
}


@pytest.mark.parametrize("mode", HOOK_MODES)
@pytest.mark.parametrize("case", list(CASES))
def test_lora_norms_and_clipped_sums_match_brute_force(case, mode):
    name, config = CASES[case]
    model, inputs, loss_fn = _peft_model(name, **config)
    lora = set(lora_parameters(model))
    assert lora and all(".lora_A." in n or ".lora_B." in n for n in lora)
    extra = _trainable(model) - lora
    # besides the adapters only PEFT's trained copies and (bias="all") biases train
    assert all(".modules_to_save." in n or (config.get("bias") == "all" and n.endswith(".bias")) for n in extra)
    if "modules_to_save" in config or config.get("task_type"):
        assert any(".modules_to_save." in n for n in extra)
    check_against_brute_force(model, inputs, loss_fn, mode)


def test_tied_copies_are_one_parameter():
    model, _, _ = _peft_model("gpt2", **CASES["gpt2-trained-tied-copies"][1])
    names = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if p.requires_grad and ".modules_to_save." in n:
            names.setdefault(id(p), []).append(n)
    assert [len(v) for v in names.values()] == [2]  # wte's and lm_head's copies share one tensor


@pytest.mark.parametrize("mode", HOOK_MODES)
@pytest.mark.parametrize("name,targets", [("gpt2", ["c_attn", "c_fc"]), ("bert-base", ["query", "value", "dense"])])
def test_lora_dropout_in_train_mode_is_exact_per_sample(name, targets, mode):
    """lora_dropout > 0 in train mode: each adapter's hook records its dropped input, so the
    per-sample gradients are those of the masks drawn in this forward. Reference: the same forward
    (same seed, same masks), one backward pass per sample's loss."""
    model, inputs, _ = _peft_model(name, target_modules=targets, lora_dropout=0.5)
    b = next(iter(inputs.values())).shape[0]
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        eval_losses = _per_sample_losses(model.eval(), inputs)
    model.train()
    torch.manual_seed(12)
    per_sample = _per_sample_losses(model, inputs)
    assert not torch.allclose(per_sample.detach(), eval_losses)  # dropout is active
    grads = [torch.autograd.grad(per_sample[i], list(params.values()), retain_graph=True) for i in range(b)]
    total = torch.stack([torch.sqrt(sum(g.pow(2).sum() for g in gs)) for gs in grads])
    per_param = {n: torch.stack([gs[j].norm() for gs in grads]) for j, n in enumerate(params)}
    scale = torch.rand(b, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) + 0.1
    clipped = {n: sum(scale[i] * grads[i][j] for i in range(b)) for j, n in enumerate(params)}
    hooks = attach_norm_hooks(model, mode=mode)
    try:
        torch.manual_seed(12)
        hooks.backward(_per_sample_losses(model, inputs).sum())
        assert_close(hooks.per_sample_norms(), total, 1e-6, "per_sample_norms")
        got = hooks.per_param_norms()
        for n in params:
            assert_close(got[n], per_param[n], 1e-6, n, floor=total.max() * 1e-3)
        cs = hooks.clipped_sum(scale)
        for n in params:
            assert_close(
                cs[n], clipped[n], 1e-6, f"clipped {n}", floor=max(c.abs().max() for c in clipped.values()) * 1e-3
            )
    finally:
        hooks.detach()


def _per_sample_losses(model, inputs):
    """One batched forward; the per-sample losses (each sample's loss depends on its row only)."""
    if "y" in inputs:
        logits = model(input_ids=inputs["ids"]).logits
        return F.cross_entropy(logits, inputs["y"], reduction="none")
    logits = model(input_ids=inputs["ids"]).logits[:, :-1]
    tokens = F.cross_entropy(logits.transpose(1, 2), inputs["ids"][:, 1:], reduction="none")
    return tokens.sum(1)


def test_any_hugging_face_model_through_dp_lora():
    """A plain transformers model (not a zoo entry, not patched): dp_lora picks PEFT's default
    targets for its model type; norms are exact."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = dp_lora(MistralForCausalLM(cfg).double(), r=4, alpha=8, init_lora_weights=False).double().eval()
    assert {n.split(".")[-4] for n in lora_parameters(model)} == {"q_proj", "v_proj"}
    ids = torch.randint(0, 128, (3, 10), generator=torch.Generator().manual_seed(1))

    def loss_fn(m, ids):
        logits = m(input_ids=ids).logits[:, :-1]
        return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")

    for mode in HOOK_MODES:
        check_against_brute_force(model, {"ids": ids}, loss_fn, mode)


# -- dp_lora ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,targets,head",
    [
        ("gpt2", {"c_attn"}, None),
        ("llama-tiny-bias", {"q_proj", "v_proj"}, None),
        ("bert-base", {"query", "value"}, "classifier"),
        ("vit-tiny-patch16", {"qkv"}, "head"),
    ],
)
def test_dp_lora_picks_targets_and_head_per_zoo_architecture(name, targets, head):
    card = dpzoo.model_card(name)
    model = dpzoo.load(name, **card.test_overrides)
    assert set(default_target_modules(model)) == targets
    pm = dp_lora(model, r=4, alpha=8)
    assert is_peft_model(pm) and not is_peft_model(dpzoo.load(name, **card.test_overrides))
    lora = lora_parameters(pm)
    assert {n.split(".")[-4] for n in lora} == targets
    trained = _trainable(pm)
    heads = trained - set(lora)
    if head is None:
        assert not heads
    else:  # PEFT's trained copy of the head, nothing else
        assert heads and all(f".{head}.modules_to_save.default." in n for n in heads)
    assert mode_trainable("lora", pm) == {id(p) for p in pm.parameters() if p.requires_grad}


def test_dp_lora_bias_all_is_lora_plus_bitfit():
    card = dpzoo.model_card("bert-base")
    model = dp_lora(dpzoo.load("bert-base", **card.test_overrides), r=4, bias="all")
    trained = _trainable(model)
    lora, head = set(lora_parameters(model)), {n for n in trained if ".modules_to_save.default." in n}
    biases = {n for n, _ in model.named_parameters() if n.endswith("bias") and "original_module" not in n}
    assert len(head) == 2 and len(biases) > 10
    assert trained == lora | head | biases  # PEFT's bias="all" minus the head's original, which never runs
    assert mode_trainable("lora", model) == {id(p) for p in model.parameters() if p.requires_grad}


def test_dp_lora_refusals_leave_the_model_untouched():
    card = dpzoo.model_card("gpt2")
    model = dpzoo.load("gpt2", **card.test_overrides)
    before = [n for n, _ in model.named_modules()]
    with pytest.raises(UnsupportedModuleError, match=r"transformer\.wte \(Embedding\).*lora_embedding_A/B"):
        dp_lora(model, target_modules=["wte", "c_attn"])
    with pytest.raises(UnsupportedModuleError, match="use_dora is refused: DoRA"):
        dp_lora(model, use_dora=True)
    with pytest.raises(UnsupportedModuleError, match="trainable_token_indices"):
        dp_lora(model, trainable_token_indices=[1, 2])
    for bad in (dict(r=0), dict(r=2.5), dict(alpha=0), dict(dropout=1.0), dict(bias="some")):
        with pytest.raises(InvalidArgumentError):
            dp_lora(model, **bad)
    assert [n for n, _ in model.named_modules()] == before and not is_peft_model(model)
    with pytest.raises(InvalidArgumentError, match="PEFT model already"):
        dp_lora(dp_lora(model))
    with pytest.raises(InvalidArgumentError, match="no default target modules for Sequential"):
        dp_lora(torch.nn.Sequential(torch.nn.Linear(4, 4)))


# -- what mode="lora" trains -------------------------------------------------------------------


def test_lora_mode_is_a_training_mode_read_from_the_table():
    assert MODES["lora"] == "auto" and not TRAINING_MODES["lora"].bias_only
    model, _, _ = _peft_model("gpt2", target_modules=["c_attn"])
    assert TRAINING_MODES["lora"].trains(model, "auto") == lora_trainable(model) == mode_trainable("lora", model)


def test_lora_mode_trains_adapters_and_modules_to_save_only():
    model, _, _ = _peft_model("bert-base", task_type="SEQ_CLS", target_modules=["query", "value"])
    lora = set(lora_parameters(model))
    head = {n for n in _trainable(model) if ".classifier.modules_to_save.default." in n}
    assert len(head) == 2
    model.base_model.model.bert.pooler.dense.weight.requires_grad_(True)  # a stray unfrozen weight
    names = dict(model.named_parameters())
    assert {n for n, p in names.items() if id(p) in mode_trainable("lora", model)} == lora | head
    assert set(apply_mode("lora", model)) == lora | head == _trainable(model)
    # adapters only; an explicit head pattern; one that matches nothing is refused
    assert {n for n, p in names.items() if id(p) in lora_trainable(model, train_head=None)} == lora | head
    pooler = {n for n in names if ".pooler." in n}
    assert {n for n, p in names.items() if id(p) in lora_trainable(model, train_head="*.pooler.dense")} == (
        lora | head | pooler
    )
    with pytest.raises(InvalidArgumentError, match="matches no parameter"):
        lora_trainable(model, train_head=["classifier"])


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_lora_plus_bitfit_through_peft_bias(bias):
    model, _, _ = _peft_model("bert-base", task_type="SEQ_CLS", target_modules=["query", "value"], bias=bias)
    names = dict(model.named_parameters())
    got = {n for n, p in names.items() if id(p) in mode_trainable("lora", model)}
    lora = set(lora_parameters(model))
    biases = got - lora - {n for n in got if ".modules_to_save." in n}
    assert biases and all(n.endswith("bias") for n in biases)
    assert not any("original_module" in n for n in got)  # the head PEFT does not run
    if bias == "lora_only":
        assert all(".base_layer.bias" in n and (".query." in n or ".value." in n) for n in biases)
        assert len(biases) == 4
    else:
        every = {n for n in names if n.endswith("bias") and "original_module" not in n and ".modules_to_save." not in n}
        assert biases == every


def test_bitfit_mode_on_a_peft_model_trains_biases_and_the_heads_copy():
    model, _, _ = _peft_model("bert-base", task_type="SEQ_CLS", target_modules=["query", "value"])
    got = set(apply_mode("bitfit", model))
    assert {n for n in got if not n.endswith("bias")} == {"base_model.model.classifier.modules_to_save.default.weight"}
    assert not any("lora_" in n or "original_module" in n for n in got)
    assert "base_model.model.bert.encoder.layer.0.attention.self.query.base_layer.bias" in got


def test_lora_mode_refusals():
    card = dpzoo.model_card("bert-base")
    plain = dpzoo.load("bert-base", **card.test_overrides)
    with pytest.raises(PrivacyUsageError, match="mode='lora' trains the LoRA adapters of a PEFT model.*dp_lora"):
        mode_trainable("lora", plain)
    ia3 = peft.get_peft_model(
        dpzoo.load("bert-base", **card.test_overrides),
        peft.IA3Config(target_modules=["query", "value", "dense"], feedforward_modules=["dense"]),
    )
    with pytest.raises(PrivacyUsageError, match="has none \\(another PEFT method\\)"):
        mode_trainable("lora", ia3)
    emb, _, _ = _peft_model("gpt2", target_modules=["wte", "c_attn"])
    assert [s.split(" ")[0] for s in unsupported_lora_layers(emb)] == ["base_model.model.transformer.wte"]
    with pytest.raises(UnsupportedModuleError, match=r"transformer\.wte \(LoRA on an embedding.*lora_embedding_A/B"):
        mode_trainable("lora", emb)
    dora, _, _ = _peft_model("gpt2", target_modules=["c_attn"], use_dora=True)
    with pytest.raises(UnsupportedModuleError, match="DoraLinearVariant: a LoRA variant"):
        mode_trainable("lora", dora)


@pytest.mark.parametrize("mode", HOOK_MODES)
def test_unclippable_adapters_are_refused_by_name_in_any_mode(mode):
    """Without mode="lora" (plain hooks, mode="auto"), the adapters used functionally are refused
    at attach, named; DoRA with its magnitude frozen still runs lora_A outside the batch layout."""
    emb, inputs, loss_fn = _peft_model("gpt2", target_modules=["wte", "c_attn"])
    with pytest.raises(UnsupportedModuleError, match=r"wte\.lora_embedding_A\.default"):
        attach_norm_hooks(emb, mode)
    dora, inputs, loss_fn = _peft_model("gpt2", target_modules=["c_attn"], use_dora=True)
    with pytest.raises(UnsupportedModuleError, match="lora_magnitude_vector"):
        attach_norm_hooks(dora, mode)
    for n, p in dora.named_parameters():
        if "lora_magnitude_vector" in n:
            p.requires_grad_(False)
    hooks = attach_norm_hooks(dora, mode)
    try:
        with pytest.raises(UnsupportedModuleError, match=r"lora_A\.default"):
            hooks.backward(loss_fn(dora, **inputs))
            hooks.per_sample_norms()
    finally:
        hooks.detach()


# -- one DP step through the engine ------------------------------------------------------------

R, SIGMA, SEED = 0.6, 0.8, 321


def _lm_data(n=10, t=12, vocab=256):
    g = torch.Generator().manual_seed(4)
    return TensorDataset(torch.randint(0, vocab, (n, t), generator=g))


def _lm_loss(m, ids):
    logits = m(input_ids=ids).logits[:, :-1]
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")


@pytest.mark.parametrize(
    "mode",
    ["auto", "bk", "instantiate", "lora"],
)
def test_one_dp_step_equals_dp_sgd_formula(mode):
    """LoRA + BiTFiT on llama-tiny-bias (dp_lora with bias="all"): the engine's update equals
    -lr · (Σ_i C_i g_i + N(0, σ²R²)) with the per-sample gradients from brute force."""
    torch.manual_seed(0)
    card = dpzoo.model_card("llama-tiny-bias")
    model = dp_lora(dpzoo.load("llama-tiny-bias", **card.test_overrides), r=4, bias="all", init_lora_weights=False)
    model = model.double().train()
    if mode == "lora":  # mode="lora" re-freezes what the user unfroze outside the LoRA set
        model.base_model.model.model.norm.weight.requires_grad_(True)
    reference = copy.deepcopy(model)
    if mode == "lora":
        reference.base_model.model.model.norm.weight.requires_grad_(False)
    lr, ds = 0.3, _lm_data()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    engine = dpzoo.PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(ds, batch_size=5),
        noise_multiplier=SIGMA,
        max_grad_norm=R,
        clipping="abadi",
        mode=mode,
        loss_reduction="sum",
        noise_seed=SEED,
        sample_seed=2,
    )
    (ids,) = next(iter(loader))
    assert 0 < ids.shape[0] < len(ds)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == [n for n, p in reference.named_parameters() if p.requires_grad]
    assert any(".lora_A." in n for n in trainable) and any(n.endswith(".bias") for n in trainable)
    grads = per_sample_grads(reference, _lm_loss, {"ids": ids}, ids.shape[0])
    norms = torch.stack([torch.sqrt(sum(g[n].pow(2).sum() for n in trainable)) for g in grads])
    c = clip_weights(norms, R, "abadi")
    assert (c < 1).any()  # some rows are clipped
    gen = torch.Generator().manual_seed(SEED)
    params = dict(model.named_parameters())
    expected = {}
    noises = seeded_noise([(params[n].shape, torch.float64) for n in trainable], SIGMA * R, gen)
    for n, noise in zip(trainable, noises):  # drawn as dpzoo draws it, in named_parameters order
        expected[n] = -lr * (sum(c[i] * grads[i][n] for i in range(len(grads))) + noise)
    before = {n: p.detach().clone() for n, p in params.items()}
    _lm_loss(model, ids).backward()
    opt.step()
    for n, p in params.items():
        if n in expected:
            assert_close(p.detach() - before[n], expected[n], 1e-6, n)
        else:
            assert torch.equal(p.detach(), before[n]), f"frozen {n} changed"
    assert engine.steps == 1 and engine.self_check_result.startswith("passed")


def _classifier_setup(mode, **make_private):
    card = dpzoo.model_card("bert-base")
    torch.manual_seed(0)
    model = dpzoo.load("bert-base", **card.test_overrides).train()
    g = torch.Generator().manual_seed(5)
    ds = TensorDataset(torch.randint(0, 256, (12, 16), generator=g), torch.randint(0, 3, (12,), generator=g))
    engine = dpzoo.PrivacyEngine()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return engine, engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(ds, batch_size=4),
        noise_multiplier=1.0,
        mode=mode,
        **make_private,
    )


def test_engine_auto_mode_trains_what_peft_left_trainable():
    """mode="auto" on a PEFT model (what works before any engine change): the adapters and the
    classifier's copy, with dropout inside LoRA, several steps, self-check passed."""
    card = dpzoo.model_card("bert-base")
    torch.manual_seed(0)
    model = dp_lora(dpzoo.load("bert-base", **card.test_overrides), r=4, dropout=0.2).train()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    g = torch.Generator().manual_seed(5)
    ds = TensorDataset(torch.randint(0, 256, (12, 16), generator=g), torch.randint(0, 3, (12,), generator=g))
    engine = dpzoo.PrivacyEngine()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt, loader = engine.make_private(
        module=model, optimizer=opt, data_loader=DataLoader(ds, batch_size=4), noise_multiplier=1.0, mode="auto"
    )
    for ids, y in loader:
        if len(y):
            F.cross_entropy(model(input_ids=ids).logits, y).backward()
        opt.step()
        opt.zero_grad()
    assert engine.steps == 3 and engine.self_check_result.startswith("passed")
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)


def test_engine_lora_mode_refuses_a_model_without_adapters():
    with pytest.raises(PrivacyUsageError, match="mode='lora' trains the LoRA adapters of a PEFT model"):
        _classifier_setup("lora")


def test_save_refuses_the_peft_wrapper_and_keeps_the_record_of_the_merged_model(tmp_path):
    """dpzoo.save(peft_model) is refused with what to save instead; the merged model saves with the
    engine's privacy record and loads back with the trained adapters merged in."""
    card = dpzoo.model_card("bert-base")
    torch.manual_seed(0)
    model = dp_lora(dpzoo.load("bert-base", **card.test_overrides), r=4).train()
    g = torch.Generator().manual_seed(5)
    ds = TensorDataset(torch.randint(0, 256, (12, 16), generator=g), torch.randint(0, 3, (12,), generator=g))
    engine = dpzoo.PrivacyEngine()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(ds, batch_size=4),
        noise_multiplier=1.0,
        target_delta=1e-5,
        mode="lora",
    )
    for ids, y in loader:
        if len(y):
            F.cross_entropy(model(input_ids=ids).logits, y).backward()
        opt.step()
        opt.zero_grad()
    with pytest.raises(SaveError, match=r"PEFT model.*merge_and_unload\(\)"):
        dpzoo.save(model, tmp_path / "wrapped")
    assert not (tmp_path / "wrapped").exists()
    model.eval()
    ids = ds.tensors[0][:3]
    with torch.no_grad():
        trained = model(input_ids=ids).logits
    merged = model.merge_and_unload()
    dpzoo.save(merged, tmp_path / "merged")
    back = dpzoo.load(tmp_path / "merged").eval()
    with torch.no_grad():
        assert_close(back(input_ids=ids).logits, trained, 1e-5, "logits")
    assert back.dpzoo_privacy["epsilon"] == pytest.approx(engine.get_epsilon(back.dpzoo_privacy["delta"]))
    assert back.dpzoo_privacy["steps"] == engine.steps == 3


# -- data-driven initialisations (EVA, CorDA): a statistic of the data outside ε ---------------------


def _eva_model():
    """PEFT's documented EVA flow on a tiny GPT-2: LoraConfig(init_lora_weights="eva"), get_peft_model,
    then initialize_lora_eva_weights on a loader of (here: the private) training data."""
    torch.manual_seed(0)
    model = dpzoo.load("gpt2", **dpzoo.model_card("gpt2").test_overrides)
    config = peft.LoraConfig(
        r=2,
        target_modules=["c_attn"],
        init_lora_weights="eva",
        eva_config=peft.EvaConfig(rho=1.0),
        task_type="CAUSAL_LM",
    )
    model = peft.get_peft_model(model, config)
    ids = _lm_data(n=16).tensors[0]
    loader = DataLoader(
        [{"input_ids": ids[i], "attention_mask": torch.ones_like(ids[i])} for i in range(16)], batch_size=8
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft.initialize_lora_eva_weights(model, loader, show_progress_bar=False)
    return model


def _make_private(model, engine=None):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    return (engine or dpzoo.PrivacyEngine()).make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(_lm_data(), batch_size=5),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        mode="lora",
        target_delta=1e-5,
        loss_reduction="sum",  # _lm_loss is a sum over the batch's tokens
    )


def test_eva_initialised_adapters_are_refused_unless_declared_public(tmp_path):
    """EVA's lora_A is an SVD of the training activations: make_private refuses it, naming the fix;
    declared public, it trains and the metadata carries the statement."""
    model = _eva_model()
    with pytest.raises(PrivacyUsageError, match=r"LoRA adapter 'default' has a data-driven initialisation \(eva"):
        _make_private(model)
    with pytest.raises(InvalidArgumentError, match="source="):
        declare_public_init(model, "default")
    declare_public_init(model, "default", source="WikiText-103 (public)")
    engine = dpzoo.PrivacyEngine()
    model, opt, loader = _make_private(model, engine)
    (ids,) = next(iter(loader))
    _lm_loss(model, ids).backward()
    opt.step()
    assert "on public data: WikiText-103 (public)" in engine.privacy_metadata()["public_statistics"]


@pytest.mark.parametrize("init", ["eva", "corda"])
def test_dp_lora_refuses_data_driven_inits_without_public_data(init):
    model = dpzoo.load("gpt2", **dpzoo.model_card("gpt2").test_overrides)
    with pytest.raises(UnsupportedModuleError, match=rf"init_lora_weights='{init}' is refused.*public_init="):
        dp_lora(model, r=2, init_lora_weights=init)
    assert not is_peft_model(model)
    with pytest.raises(InvalidArgumentError, match="public_init applies to a data-driven"):
        dp_lora(model, r=2, public_init="some public corpus")


def test_data_driven_inits_are_found_in_nested_models_and_unknown_inits_are_refused():
    """An EVA PeftModel inside another module, and an init dpzoo does not know to be data-free
    (LoRA-GA computes gradients on a data loader), are refused like a top-level EVA model."""

    class Wrap(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids):
            return self.inner(input_ids=input_ids)

    with pytest.raises(PrivacyUsageError, match=r"LoRA adapter 'default' has a data-driven initialisation \(eva"):
        _make_private(Wrap(_eva_model()))
    model = dpzoo.load("gpt2", **dpzoo.model_card("gpt2").test_overrides)
    model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["c_attn"], task_type="CAUSAL_LM"))
    model.peft_config["default"].init_lora_weights = "lora_ga"  # as PEFT's LoRA-GA flow leaves it
    with pytest.raises(PrivacyUsageError, match=r"data-driven initialisation \(lora_ga: LoRA-GA"):
        _make_private(model)
    model.peft_config["default"].init_lora_weights = "some_future_init"
    with pytest.raises(PrivacyUsageError, match="not know to be data-free"):
        _make_private(model)
    for init in (True, "gaussian", "pissa_niter_4", "olora"):
        model.peft_config["default"].init_lora_weights = init
        assert data_driven_inits(model) == {}


def test_a_step_inside_disable_adapter_is_refused_by_name(_quiet):
    """Issue 33: the refusal said only "the model has no trainable parameters"."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["0", "2"])).double()
    data = TensorDataset(torch.randn(8, 5, dtype=torch.float64), torch.arange(8) % 3)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = dpzoo.PrivacyEngine().make_private(
            module=model,
            optimizer=opt,
            data_loader=DataLoader(data, batch_size=8),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            mode="lora",
        )
    x, y = next(iter(loader))
    with pytest.raises(UnsupportedModuleError, match="disable_adapter"), model.disable_adapter():
        F.cross_entropy(model(x), y).backward()
