"""Opacus runs a DP step on zoo models with dpzoo's rules registered, in hooks and ghost
modes, and its private gradient (noise 0) equals the brute-force clipped mean."""

from __future__ import annotations

import warnings

import pytest
import torch
from grad_reference import assert_close, per_sample_grads

import dpzoo
from dpzoo.losses import SequenceCrossEntropy

pytest.importorskip("opacus", reason="opacus is in the `test` extra: pip install -e '.[test]'")
from opacus import PrivacyEngine  # noqa: E402

from dpzoo.engines.opacus import make_private, register_opacus_rules  # noqa: E402

C = 0.5  # max_grad_norm, small enough that most samples are clipped


def _setup(name, b=4, **extra):
    torch.manual_seed(0)
    card = dpzoo.model_card(name)
    model = dpzoo.load(name, **card.test_overrides, **extra).double().train()  # Opacus wants train mode
    for m in model.modules():  # ... and a deterministic forward for the comparison
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    spec = card.example_input
    g = torch.Generator().manual_seed(1)
    if card.task == "sequential-recommendation":
        x = torch.randint(1, spec["vocab_size"], (b, spec["seq_len"]), generator=g)
        x[0, :2] = 0  # left padding
        y = torch.randint(1, spec["vocab_size"], (b, spec["seq_len"]), generator=g)
        if hasattr(model, "set_token_frequencies"):  # DPFormer: Re-Attention active, as in training
            model.set_token_frequencies(x)
            model.set_dp_noise(noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=b)
        crit = SequenceCrossEntropy(ignore_index=0)
        fwd = lambda m, x: m(x)  # noqa: E731
    elif spec["kind"] == "image":
        x = torch.randn(b, *spec["shape"], generator=g, dtype=torch.float64)
        y = torch.randint(0, card.test_overrides["num_classes"], (b,), generator=g)
        crit = torch.nn.CrossEntropyLoss()
        fwd = lambda m, x: m(x)  # noqa: E731
    else:
        x = torch.randint(0, spec["vocab_size"], (b, spec["seq_len"]), generator=g)
        y = x.clone()
        crit = SequenceCrossEntropy(shift=True)
        fwd = lambda m, x: m(input_ids=x).logits  # noqa: E731
    return model, x, y, crit, fwd


def _expected(model, x, y, crit, fwd):
    def loss_fn(m, x, y):
        return crit(fwd(m, x), y)

    grads = per_sample_grads(model, loss_fn, {"x": x, "y": y}, x.shape[0])
    names = list(grads[0])
    norms = torch.stack([torch.sqrt(sum(g[n].pow(2).sum() for n in names)) for g in grads])
    factor = (C / (norms + 1e-6)).clamp(max=1.0)  # Opacus' own factor: this compares with its engine
    return {n: sum(factor[i] * grads[i][n] for i in range(len(grads))) / len(grads) for n in names}


def _opacus_step(model, x, y, crit, fwd, mode):
    ds = torch.utils.data.TensorDataset(x, y)
    loader = torch.utils.data.DataLoader(ds, batch_size=x.shape[0])
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = make_private(
            PrivacyEngine(),
            module=model,
            optimizer=opt,
            data_loader=loader,
            noise_multiplier=0.0,
            max_grad_norm=C,
            grad_sample_mode=mode,
            poisson_sampling=False,
            criterion=crit,
        )
        if mode == "ghost":
            pm, popt, pcrit, ploader = out
        else:
            (pm, popt, ploader), pcrit = out, crit
        xb, yb = next(iter(ploader))
        pcrit(fwd(pm, xb), yb).backward()
        popt.step()
    return {n.removeprefix("_module."): p.grad for n, p in pm.named_parameters() if p.requires_grad}


CASES = [
    ("resnet18-gn-bias", "hooks"),
    ("resnet18-gn-bias", "ghost"),
    ("vit-tiny-patch16", "hooks"),
    ("vit-tiny-patch16", "ghost"),
    ("gpt2", "hooks"),
    ("llama-tiny-bias", "hooks"),
    ("llama-tiny-bias", "ghost"),
    ("efficientnet-lite0-gn-bias", "hooks"),
    ("dpformer", "hooks"),
    ("transformer-seqrec-untied", "ghost"),
    ("gru-seqrec", "hooks"),
]


@pytest.mark.parametrize("name, mode", CASES)
def test_opacus_dp_step_equals_brute_force(name, mode):
    model, x, y, crit, fwd = _setup(name)
    expected = _expected(model, x, y, crit, fwd)
    got = _opacus_step(model, x, y, crit, fwd, mode)
    assert set(got) == set(expected)
    for n in expected:
        assert_close(got[n], expected[n], 1e-6, n)


def test_opacus_ghost_untied_gpt2():
    model, x, y, crit, fwd = _setup("gpt2", tie_word_embeddings=False)
    expected = _expected(model, x, y, crit, fwd)
    got = _opacus_step(model, x, y, crit, fwd, "ghost")
    for n in expected:
        assert_close(got[n], expected[n], 1e-6, n)


def test_opacus_ghost_with_tied_embeddings_gives_dpzoo_error():
    model, x, y, crit, fwd = _setup("gpt2")
    with pytest.raises(dpzoo.UnsupportedModuleError, match="tied parameters.*Phantom Clipping"):
        _opacus_step(model, x, y, crit, fwd, "ghost")


def test_registration_covers_dpzoo_modules():
    from opacus.grad_sample import GradSampleModule
    from transformers.pytorch_utils import Conv1D

    register_opacus_rules()
    assert {dpzoo.nn.RMSNorm, Conv1D} <= set(GradSampleModule.GRAD_SAMPLERS)
