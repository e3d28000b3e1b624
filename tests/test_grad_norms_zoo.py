"""Per-sample norms and clipped sums on zoo entries (small configurations) against brute force,
in full and in bias-only (DP-BiTFiT) training; bias-only stores no activations; unsupported
trainable layers raise, naming themselves."""

from __future__ import annotations

import pytest
import torch
from grad_reference import assert_close, check_against_brute_force, zoo_model_and_inputs
from torch import nn

import dpzoo
from dpzoo.grad_norms import attach_norm_hooks

ENTRIES = [
    "cnn-tanh-gn",
    "mlp-tanh",
    "wrn16-4-gn",
    "wrn28-10-gn",
    "resnet18-gn-bias",
    "convnext-tiny",
    "nf-resnet50",
    "vit-tiny-patch16",
    "gpt2",
    "llama-tiny-bias",
    "qwen2-bias",
    "mistral-bias",
    "gemma-bias",
    "bert-base",
    "roberta-base",
    "efficientnet-lite0-gn-bias",
    "transformer-seqrec",
    "transformer-seqrec-untied",
    "gru-seqrec",
    "lstm-seqrec",
    "dpformer",
]


def _bias_only(model):
    for n, p in model.named_parameters():
        p.requires_grad_(n.rsplit(".", 1)[-1].endswith("bias"))


@pytest.mark.parametrize("mode", ["auto", "ghost", "instantiate"])
@pytest.mark.parametrize("name", ENTRIES)
def test_zoo_full_training_norms(name, mode):
    model, inputs, loss_fn = zoo_model_and_inputs(name)
    check_against_brute_force(model, inputs, loss_fn, mode)


@pytest.mark.parametrize("name", ENTRIES)
def test_zoo_bias_only_norms_and_no_activations(name):
    model, inputs, loss_fn = zoo_model_and_inputs(name)
    _bias_only(model)
    hooks = attach_norm_hooks(model)
    try:
        # DP-BiTFiT: no forward pre-hook on any layer, nothing stored by the forward pass (a layer's
        # forward hook only puts a gradient hook on its output). The root's hooks keep the batch
        # size and the output tensors from which parameter uses are counted after loss.backward():
        # a privacy check, not an activation store.
        assert all(not m._forward_pre_hooks for m in model.modules() if m is not model)
        loss = loss_fn(model, **inputs)
        assert hooks.records == ()
        hooks.backward(loss)
        assert hooks.records and all(u.activations is None for u in hooks.records)
    finally:
        hooks.detach()
    check_against_brute_force(model, inputs, loss_fn, "auto")


def test_gpt2_tied_embedding_exact_and_untied_too():
    model, inputs, loss_fn = zoo_model_and_inputs("gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight
    check_against_brute_force(model, inputs, loss_fn, "auto")
    torch.manual_seed(0)
    card = dpzoo.model_card("gpt2")
    untied = dpzoo.load("gpt2", **card.test_overrides, tie_word_embeddings=False).double().eval()
    check_against_brute_force(untied, inputs, loss_fn, "auto")


def test_float32_resnet_within_1e4():
    model, inputs, loss_fn = zoo_model_and_inputs("resnet18-gn-bias")
    model = model.float()
    inputs = {k: (v.float() if v.is_floating_point() else v) for k, v in inputs.items()}
    check_against_brute_force(model, inputs, loss_fn, "auto", tol=1e-4)


# --- no silent privacy leak ---------------------------------------------------------------


class WithUnsupported(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bi = nn.Bilinear(4, 4, 4)  # no per-sample rule in dpzoo

    def forward(self, x):
        h = self.lin(x)
        return self.bi(h, h)


def test_unsupported_trainable_module_raises_naming_it():
    with pytest.raises(dpzoo.UnsupportedModuleError, match=r"Module bi \(Bilinear\).*bi\.weight"):
        attach_norm_hooks(WithUnsupported())
    m = WithUnsupported()
    m.bi.requires_grad_(False)  # frozen: nothing to account for
    attach_norm_hooks(m).detach()


def test_unsupported_options_raise():
    m = nn.Sequential(nn.Embedding(10, 3, max_norm=1.0))
    with pytest.raises(dpzoo.UnsupportedModuleError, match="0 \\(Embedding\\): max_norm"):
        attach_norm_hooks(m)
    with pytest.raises(dpzoo.UnsupportedModuleError, match=r"Module 0 \(Bilinear\).*0\.weight"):
        attach_norm_hooks(nn.Sequential(nn.Bilinear(2, 2, 3)))
    with pytest.raises(dpzoo.UnsupportedModuleError, match="lstm"):
        attach_norm_hooks(nn.ModuleDict({"lstm": nn.LSTM(3, 3)}))


class FunctionalReuse(nn.Module):
    """Uses emb.weight outside the Embedding module: the output projection is functional."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 3)

    def forward(self, ids):
        return self.emb(ids) @ self.emb.weight.t()


@pytest.mark.parametrize("backward", ["hooks", "loss"])
def test_parameter_used_outside_its_module_raises(backward):
    m = FunctionalReuse()
    hooks = attach_norm_hooks(m)
    loss = m(torch.randint(0, 7, (2, 3))).sum()
    with pytest.raises(dpzoo.UnsupportedModuleError, match="emb.weight is used 2 time\\(s\\).*recorded 1"):
        if backward == "hooks":
            hooks.backward(loss)
        else:
            loss.backward()
            hooks.per_sample_norms()


def test_input_modified_in_place_after_use_raises():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            x = x * 1.0
            y = self.lin(x)
            x.mul_(2)  # the stored activation changes after the layer used it
            return y + x

    m = Bad()
    hooks = attach_norm_hooks(m)
    loss = m(torch.randn(2, 3)).sum()
    # Ghost differentiation never unpacks the layer's saved input, so autograd cannot see the
    # change (loss.backward() would): dpzoo's own version check must.
    hooks.backward(loss)
    with pytest.raises(dpzoo.UnsupportedModuleError, match="modified in place"):
        hooks.per_sample_norms()


def test_no_trainable_parameters_is_an_error():
    m = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(dpzoo.UnsupportedModuleError, match="no trainable"):
        attach_norm_hooks(m)


def test_detach_removes_every_hook_and_results_need_a_backward():
    model, inputs, loss_fn = zoo_model_and_inputs("vit-tiny-patch16")
    hooks = attach_norm_hooks(model)
    with pytest.raises(dpzoo.PrivacyUsageError, match="backward"):
        hooks.per_sample_norms()
    hooks.detach()
    assert all(not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks for m in model.modules())
    assert isinstance(model.cls_token, nn.Parameter)


def test_ghost_differentiation_computes_no_parameter_gradient():
    model, inputs, loss_fn = zoo_model_and_inputs("gpt2")
    hooks = attach_norm_hooks(model)
    hooks.backward(loss_fn(model, **inputs))
    assert all(p.grad is None for p in model.parameters())
    assert hooks.per_sample_norms().shape == (3,)
    hooks.detach()


def test_steps_do_not_mix():
    """A second forward/backward replaces the first step's records."""
    model, inputs, loss_fn = zoo_model_and_inputs("resnet18-gn-bias")
    hooks = attach_norm_hooks(model)
    hooks.backward(loss_fn(model, **inputs))
    first = hooks.per_sample_norms().clone()
    half = {k: v[:2] for k, v in inputs.items()}
    hooks.backward(loss_fn(model, **half))
    second = hooks.per_sample_norms()
    assert second.shape == (2,)
    assert_close(second, first[:2], 1e-9, "same samples, same norms")
    hooks.detach()


def test_steps_release_their_activations():
    """Regression: hooks on outputs must not keep every step's activations alive (a reference
    cycle through autograd's C++ nodes leaked ~300 MB per step on a small GPT-2)."""
    import gc
    import weakref

    model, inputs, loss_fn = zoo_model_and_inputs("gpt2")
    hooks = attach_norm_hooks(model, ghost_backward=True)
    refs = []
    handle = model.transformer.h[0].mlp.c_fc.register_forward_hook(lambda m, a, o: refs.append(weakref.ref(o)))
    for _ in range(3):
        loss_fn(model, **inputs).backward()
        hooks.clipped_sum(torch.ones(3, dtype=torch.float64))
        hooks.clear()
    handle.remove()
    hooks.detach()
    gc.collect()
    assert all(r() is None for r in refs)
