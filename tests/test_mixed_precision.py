"""Mixed precision through the engine: bfloat16 autocast works, with per-sample norms and clipped sums
formed in float32 and compared with a float64 brute-force reference; torch's GradScaler is refused
before anything is clipped (float16 loss scaling that keeps the guarantee: tests/test_grad_scaler.py).

Tolerance (docs/DESIGN.md, "Mixed precision"): under bfloat16 autocast the layers compute in bfloat16
(8 significant bits), so the activations and output gradients dpzoo records carry relative errors of
a few 1e-3 per layer; the norms and clipped sums are then formed in float32. Against the float64
reference of the same model without autocast they agree to 5% of the largest value here."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from dp_reference import clip_weights
from grad_reference import assert_close, reference, zoo_model_and_inputs
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpzoo
from dpzoo.errors import PrivacyUsageError
from dpzoo.grad_norms import attach_norm_hooks

BF16_TOL = 5e-2


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))


def _mlp_loss(model, x, y):
    return F.cross_entropy(model(x), y, reduction="sum")


def _case(case):
    if case == "mlp":
        model = _mlp()
        g = torch.Generator().manual_seed(1)
        inputs = {"x": torch.randn(6, 10, generator=g), "y": torch.randint(0, 4, (6,), generator=g)}
        return model.eval(), inputs, _mlp_loss
    model, inputs, loss_fn = zoo_model_and_inputs(case, seed=0)
    inputs = {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}
    return model.float().eval(), inputs, loss_fn  # eval: dropout off, both passes compute one function


def _check(hooks, total, clipped, scale, tol):
    norms = hooks.per_sample_norms()
    assert norms.dtype == torch.float32  # accumulated in float32, not bfloat16
    assert_close(norms, total, tol, "norms")
    sums = hooks.clipped_sum(scale.float())
    biggest = max(c.abs().max() for c in clipped.values())
    for n, c in clipped.items():
        assert sums[n].dtype == torch.float32
        assert_close(sums[n], c, tol, n, floor=biggest * tol)


@pytest.mark.parametrize("mode", ["auto", "ghost", "instantiate"])
@pytest.mark.parametrize("case", ["mlp", "gpt2", "resnet18-gn-bias"])
def test_bf16_autocast_norms_and_sums_are_those_of_the_autocast_model(case, mode):
    """Against torch's own per-sample backward passes under the same autocast: dpzoo's hooks see
    what the bfloat16 layers computed, and only the float32 arithmetic after that differs."""
    model, inputs, loss_fn = _case(case)
    b = next(iter(inputs.values())).shape[0]
    scale = torch.rand(b, dtype=torch.float64, generator=torch.Generator().manual_seed(9)) + 0.1

    def autocast_loss(m, **kw):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss_fn(m, **kw).float()

    total, _, clipped = reference(model, autocast_loss, inputs, b, scale.float())
    with attach_norm_hooks(model, mode=mode) as hooks:
        hooks.backward(autocast_loss(model, **inputs))
        _check(hooks, total, clipped, scale, 1e-2)


@pytest.mark.parametrize("case", ["mlp", "gpt2"])
def test_bf16_autocast_norms_and_sums_match_a_float64_reference(case):
    """Against the float64 model without autocast: within BF16_TOL. (Not on the random ResNet-18,
    whose bfloat16 forward alone moves its per-sample norms by up to 2x, for torch's own gradients too.)"""
    model, inputs, loss_fn = _case(case)
    b = next(iter(inputs.values())).shape[0]
    scale = torch.rand(b, dtype=torch.float64, generator=torch.Generator().manual_seed(9)) + 0.1
    ref64 = copy.deepcopy(model).double()
    total, _, clipped = reference(
        ref64, loss_fn, {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}, b, scale
    )
    with attach_norm_hooks(model) as hooks:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(model, **inputs)
        hooks.backward(loss)
        _check(hooks, total, clipped, scale, BF16_TOL)


def test_a_dp_step_under_bf16_autocast_is_the_dp_sgd_formula():
    """The engine's update under autocast: -lr · (Σ_i C_i g_i + noise)/B with g_i from a float64
    reference, the noise drawn from the same seeded generator; self-check passed."""
    torch.manual_seed(0)
    model = _mlp()
    reference_model = copy.deepcopy(model).double()
    g = torch.Generator().manual_seed(3)
    ds = TensorDataset(torch.randn(40, 10, generator=g), torch.randint(0, 4, (40,), generator=g))
    sigma, r, lr = 0.7, 0.5, 0.2
    engine = dpzoo.PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        data_loader=DataLoader(ds, batch_size=8),
        noise_multiplier=sigma,
        max_grad_norm=r,
        loss_reduction="sum",
        noise_seed=5,
        sample_seed=6,
    )
    x, y = next(iter(loader))
    grads = [
        torch.autograd.grad(
            _mlp_loss(reference_model, x[i : i + 1].double(), y[i : i + 1]), reference_model.parameters()
        )
        for i in range(len(y))
    ]
    norms = torch.stack([torch.sqrt(sum(t.pow(2).sum() for t in gi)) for gi in grads])
    c = clip_weights(norms, r, "abadi")
    gen = torch.Generator().manual_seed(5)
    params = list(model.parameters())
    noise = [torch.normal(0.0, sigma * r, size=p.shape, generator=gen) for p in params]
    expected = [-lr * (sum(c[i] * grads[i][k] for i in range(len(y))).float() + noise[k]) for k in range(len(params))]
    before = [p.detach().clone() for p in params]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = _mlp_loss(model, x, y)
    loss.backward()
    opt.step()
    assert engine.steps == 1 and engine.self_check_result.startswith("passed")
    signal = max(e.abs().max() for e in expected)
    for p, b0, e in zip(params, before, expected):
        assert_close(p.detach() - b0, e, BF16_TOL, floor=signal)


def test_float16_loss_scaling_is_refused_before_clipping():
    model = _mlp()
    ds = TensorDataset(torch.randn(40, 10), torch.randint(0, 4, (40,)))
    engine = dpzoo.PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(ds, batch_size=8),
        noise_multiplier=1.0,
    )
    scaler = torch.amp.GradScaler("cpu")
    before = [p.detach().clone() for p in model.parameters()]
    for x, y in loader:
        if len(y):
            break
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    with pytest.raises(PrivacyUsageError, match="GradScaler"):
        scaler.step(opt)
    assert engine.steps == 0 and all(torch.equal(p, b0) for p, b0 in zip(model.parameters(), before))


def _tf32_round(x: torch.Tensor) -> torch.Tensor:
    """x (float32) rounded to TF32's 10 mantissa bits, nearest-even on the 13 dropped bits."""
    bits = x.view(torch.int32)
    keep = bits + 0x0FFF + ((bits >> 13) & 1)
    return (keep & ~0x1FFF).view(torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_upcast_half_values_are_exact_in_tf32(dtype):
    """Why dpzoo may run the float32 products of upcast half-precision reps on TF32 tensor cores
    (reps.exact_matmuls): every such value survives TF32's rounding unchanged, so each product is the
    float32 one. A float32 value with more mantissa bits does not (the check can fail)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(100_000, generator=g) * 1e3).to(dtype).float()
    assert torch.equal(_tf32_round(x), x)
    full = torch.randn(1000, generator=g)
    assert not torch.equal(_tf32_round(full), full)


def test_tf32_is_switched_on_only_for_half_precision_on_cuda_and_restored():
    from dpzoo.grad_norms import reps as R

    before = torch.get_float32_matmul_precision()
    rep = R.Factored(torch.randn(2, 1, 3, 4).bfloat16(), torch.randn(2, 1, 3, 5).bfloat16(), (5, 4))
    assert not R.half_on_cuda(rep)  # CPU: "high" may mean bfloat16 arithmetic there
    seen = []
    with R.exact_matmuls(False):
        seen.append(torch.get_float32_matmul_precision())
    with pytest.raises(RuntimeError, match="inside"):
        with R.exact_matmuls(True):
            seen.append(torch.get_float32_matmul_precision())
            raise RuntimeError("inside")
    assert seen == [before, "high"] and torch.get_float32_matmul_precision() == before


@pytest.mark.parametrize("user_setting", ["high", "medium"])
def test_float32_norms_run_at_highest_precision_whatever_the_user_set(user_setting):
    """TF32 (CUDA) or bfloat16 (CPU at "medium") would round a float32 model's values inside the
    Gram matmuls, beyond what the rounding bound of grad_norms/rounding.py covers."""
    from dpzoo.grad_norms import reps as R

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(user_setting)
    try:
        with R.exact_matmuls(False):
            inside = torch.get_float32_matmul_precision()
        assert inside == "highest" and torch.get_float32_matmul_precision() == user_setting
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (TF32 tensor cores)")
def test_bf16_ghost_norms_on_cuda_match_float64():
    from dpzoo.grad_norms import reps as R

    g = torch.Generator(device="cuda").manual_seed(0)
    left = torch.randn(8, 1, 256, 512, device="cuda", generator=g).bfloat16()
    right = torch.randn(8, 1, 256, 384, device="cuda", generator=g).bfloat16()
    rep = R.Factored(left, right, (384, 512))
    want = R.sq_norm(R.Factored(left.double(), right.double(), (384, 512)), ghost=True)
    for ghost in (True, False):
        got = R.sq_norm(rep, ghost=ghost).double()
        assert torch.allclose(got, want, rtol=1e-4), (ghost, (got / want - 1).abs().max())
