"""Mixed precision through the engine: bfloat16 autocast works, with per-sample norms and clipped sums
formed in float32 and compared with a float64 brute-force reference; torch's GradScaler is refused
before anything is clipped (float16 loss scaling that keeps the guarantee: tests/test_grad_scaler.py).

Tolerance (docs/DESIGN.md, "Mixed precision"): under bfloat16 autocast the layers compute in bfloat16
(8 significant bits), so the activations and output gradients dpzoo records carry relative errors of
a few 1e-3 per layer; the norms and clipped sums are then formed in float32. Against the float64
reference of the same model without autocast they agree to 5% of the largest value here."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from dp_reference import clip_weights, seeded_noise
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
    _check_autocast_model(case, mode, "cpu")


def _check_autocast_model(case, mode, device):
    model, inputs, loss_fn = _case(case)
    model, inputs = model.to(device), {k: v.to(device) for k, v in inputs.items()}
    b = next(iter(inputs.values())).shape[0]
    scale = torch.rand(b, dtype=torch.float64, generator=torch.Generator().manual_seed(9)).to(device) + 0.1

    def autocast_loss(m, **kw):
        with torch.autocast(device, dtype=torch.bfloat16):
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
    noise = seeded_noise(params, sigma * r, gen)
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_products_of_half_values_are_exact_in_float32(dtype):
    """Why dpzoo multiplies half-precision factors with a float32 result (grad_norms/half.py):
    each product of two half values is the exact one. Two float32 values' product is not."""
    g = torch.Generator().manual_seed(0)
    a, b = ((torch.randn(100_000, generator=g) * 10).to(dtype).float() for _ in range(2))
    assert torch.equal((a * b).double(), a.double() * b.double())
    a, b = torch.randn(1000, generator=g), torch.randn(1000, generator=g)
    assert not torch.equal((a * b).double(), a.double() * b.double())


def test_a_rounded_down_scale_times_a_bfloat16_value_splits_exactly_into_two():
    from dpzoo.grad_norms.half import round_toward_zero, split_bfloat16

    g = torch.Generator().manual_seed(1)
    scale = torch.rand(5000, generator=g) * 3
    low = round_toward_zero(scale, torch.bfloat16)
    assert low.dtype == torch.bfloat16 and (low.float() <= scale).all() and (low.float() > scale * (1 - 2**-7)).all()
    x = low.float() * (torch.randn(5000, generator=g) * 1e-3).bfloat16().float()
    hi, lo = split_bfloat16(x)
    assert torch.equal(hi.double() + lo.double(), x.double())
    full = torch.randn(5000, generator=g)  # 24 significant bits: two bfloat16 values cannot hold them
    hi, lo = split_bfloat16(full)
    assert not torch.equal(hi.double() + lo.double(), full.double())


def _half_rep(device="cpu", b=6, t=5, r=7, c=9, seed=0):
    from dpzoo.grad_norms import reps as R

    g = torch.Generator().manual_seed(seed)
    left, right = torch.randn(b, 1, t, r, generator=g), torch.randn(b, 1, t, c, generator=g) * 1e-2
    return R.Factored(left.bfloat16().to(device), right.bfloat16().to(device), (c, r))


def _float64(rep):
    from dpzoo.grad_norms import reps as R

    return R.Factored(rep.left.double(), rep.right.double(), rep.shape)


def _check_half_rep_against_float64(rep, tol):
    """Norms (ghost and instantiated) and the clipped sum of bfloat16 factors against float64 on the
    same values, the clipped sum with the scale rounded toward zero to bfloat16."""
    from dpzoo.grad_norms import reps as R
    from dpzoo.grad_norms.half import round_toward_zero
    from dpzoo.grad_norms.rounding import dense_chunk, gamma

    exact = _float64(rep)
    for ghost in (True, False):
        got, want = R.sq_norm(rep, ghost=ghost).double(), R.sq_norm(exact, ghost=ghost)
        assert got.dtype == torch.float64 and R.sq_norm(rep, ghost=ghost).dtype == torch.float32
        if ghost:
            torch.testing.assert_close(got, want, rtol=tol, atol=0)
        else:  # a dense float32 norm, taken up by its rounding bound γ_{k+8} (k: its run length)
            assert (got >= want).all(), (got - want) / want
            bound = 2 * gamma(dense_chunk(rep.left) + 8, 2.0**-24)
            assert (got <= want * (1 + bound + tol)).all(), ((got - want) / want, bound)
    scale = torch.rand(rep.batch_size, generator=torch.Generator().manual_seed(2), device="cpu").to(rep.left.device)
    summed = R.clipped_sum(rep, scale)
    assert summed.dtype == torch.float32 and summed.shape == rep.shape
    want = R.clipped_sum(exact, round_toward_zero(scale, torch.bfloat16).double())
    torch.testing.assert_close(summed.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    assert not torch.allclose(summed.double(), R.clipped_sum(exact, scale.double() * 1.01), rtol=tol)


@pytest.mark.parametrize("launch", [False, True])
@pytest.mark.parametrize("shape", [(6, 5, 7, 9), (3, 40, 300, 2), (2, 1, 600, 520)])
def test_bf16_factors_norms_and_clipped_sums_are_those_of_their_values(shape, launch, monkeypatch):
    """``launch``: the GPU's paths (runs of 1,024 in dense norms, batched Grams) run on the CPU: a
    CUDA run on 2026-11-28 found this test's tolerance written for runs of 32."""
    from dpzoo.grad_norms import half

    if launch:
        monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})
    b, t, r, c = shape
    _check_half_rep_against_float64(_half_rep(b=b, t=t, r=r, c=c), 1e-5)


def test_a_linear_under_bf16_autocast_hands_over_its_factors_in_bf16(monkeypatch):
    """The fast path is taken: a Linear's factors reach the products as the autocast layer computed
    them (its float32 input cast to bfloat16: what autocast multiplied), not as upcast copies."""
    from dpzoo.grad_norms import reps as R
    from dpzoo.grad_norms.assembly import rule_operands
    from dpzoo.grad_norms.registry import find_rule

    x, g = torch.randn(6, 10), torch.randn(6, 32).bfloat16()
    (a,), got = rule_operands(find_rule(nn.Linear(10, 32)), (x,), g)
    assert a.dtype == torch.bfloat16 and torch.equal(a, x.bfloat16()) and got is g
    (a,), _ = rule_operands(find_rule(nn.LayerNorm(10)), (x,), g)  # a rule that computes: float32
    assert a.dtype == torch.float32
    seen, product = [], R.product
    monkeypatch.setattr(R, "product", lambda u, v: seen.append((u.dtype, v.dtype, u.shape[-1])) or product(u, v))
    model = _mlp()
    with attach_norm_hooks(model, mode="ghost") as hooks:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _mlp_loss(model, x, torch.randint(0, 4, (6,)))
        hooks.backward(loss)
        hooks.per_sample_norms()
    assert (torch.bfloat16, torch.bfloat16, 10) in seen  # the first Linear's input Gram, in bf16


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect"])
def test_a_conv_under_bf16_autocast_hands_over_its_patches_in_bf16(padding_mode):
    """A convolution's rule only pads and unfolds: its patches reach the products in bfloat16 (the
    input as autocast cast it; padding commutes with the cast), its bias sums in float32, and the
    norms and clipped sums are still those of torch's per-sample gradients under the same autocast."""
    from dpzoo.grad_norms.assembly import rule_operands
    from dpzoo.grad_norms.registry import find_rule

    conv = nn.Conv2d(3, 4, 3, padding=1, padding_mode=padding_mode)
    x, g = torch.randn(2, 3, 6, 6), torch.randn(2, 4, 6, 6).bfloat16()
    (a,), got = rule_operands(find_rule(conv), (x,), g)
    assert a.dtype == torch.bfloat16 and torch.equal(a, x.bfloat16()) and got is g
    reps = find_rule(conv).fn(conv, (a,), g, {"weight", "bias"})
    assert reps["weight"].left.dtype == reps["weight"].right.dtype == torch.bfloat16
    assert reps["bias"].grad.dtype == torch.float32
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, padding_mode=padding_mode), nn.GroupNorm(2, 4), nn.ReLU(),
                          nn.Conv2d(4, 2, 3, stride=2), nn.Flatten(), nn.Linear(8, 3))  # fmt: skip
    inputs = {"x": torch.randn(5, 3, 6, 6), "y": torch.randint(0, 3, (5,))}
    scale = torch.rand(5, dtype=torch.float64, generator=torch.Generator().manual_seed(9)) + 0.1

    def autocast_loss(m, x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.cross_entropy(m(x), y, reduction="sum").float()

    total, _, clipped = reference(model, autocast_loss, inputs, 5, scale.float())
    for mode in ("ghost", "instantiate"):
        with attach_norm_hooks(model, mode=mode) as hooks:
            hooks.backward(autocast_loss(model, **inputs))
            _check(hooks, total, clipped, scale, 1e-2)


def _precisions() -> list[str]:
    return [torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision]


@pytest.mark.parametrize("api", ["legacy", "global", "per-backend"])
def test_norm_matmuls_run_at_ieee_precision_and_restore_the_users_setting(api):
    """Whichever of torch's APIs the user set TF32 or bfloat16 matmuls with, dpzoo's products run at
    IEEE precision and the user's setting is back afterwards, even after an error (the legacy API
    raised inside dpzoo for a user of torch.backends.fp32_precision)."""
    from dpzoo.grad_norms.half import exact_matmuls

    legacy, glob = torch.get_float32_matmul_precision(), torch.backends.fp32_precision
    backends = _precisions()
    try:
        if api == "legacy":
            torch.set_float32_matmul_precision("medium")
        elif api == "global":
            torch.backends.fp32_precision = "tf32"
        else:
            torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        user = _precisions()
        with pytest.raises(RuntimeError, match="inside"):
            with exact_matmuls():
                assert _precisions() == ["ieee", "ieee"]
                with exact_matmuls():  # nested (the hooks enter once, every product again): a no-op
                    assert _precisions() == ["ieee", "ieee"]
                assert _precisions() == ["ieee", "ieee"], "the inner exit restored the user's setting too early"
                raise RuntimeError("inside")
        assert _precisions() == user
        with exact_matmuls():  # entered afresh after an error: the nesting depth was reset
            assert _precisions() == ["ieee", "ieee"]
        assert _precisions() == user
    finally:
        torch.backends.fp32_precision = glob
        torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision = backends
        torch.set_float32_matmul_precision(legacy)


def test_one_thread_leaving_ieee_matmuls_does_not_lower_another_threads_precision():
    """The precision settings are the process's: thread A leaving its exact_matmuls while thread B
    is still inside its own (a step in each) must leave B at IEEE; B leaving restores the user's."""
    import threading

    from dpzoo.grad_norms.half import exact_matmuls

    backends = _precisions()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = []

    def thread_a():
        with exact_matmuls():
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def thread_b():
        a_in.wait(10)
        with exact_matmuls():
            b_in.set()
            a_out.wait(10)
            seen.append(_precisions())
            with exact_matmuls():  # nested inside B after A left: still a no-op
                seen.append(_precisions())
        seen.append(_precisions())

    try:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision = "tf32", "bf16"
        user = _precisions()
        threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert seen == [["ieee", "ieee"], ["ieee", "ieee"], user]
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision = backends


def _child_precisions(queue):
    from dpzoo.grad_norms.half import exact_matmuls

    before = _precisions()
    with exact_matmuls():
        inside = _precisions()
    queue.put((before, inside, _precisions()))


def test_ieee_matmuls_survive_a_setting_changed_mid_step_and_a_fork():
    """A nested entry sets IEEE again if the settings were changed inside the context (by another
    thread, or an exit an interrupt cut short); a child forked while the parent is inside one (a
    DataLoader worker) starts with the user's settings and a working lock, not the parent's count."""
    import multiprocessing as mp

    from dpzoo.grad_norms.half import exact_matmuls

    backends = _precisions()
    try:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision = "tf32", "bf16"
        user = _precisions()
        with exact_matmuls():
            torch.backends.mkldnn.matmul.fp32_precision = "bf16"  # changed behind the context's back
            with exact_matmuls():
                assert _precisions() == ["ieee", "ieee"]
            if "fork" in mp.get_all_start_methods():
                ctx = mp.get_context("fork")
                queue = ctx.Queue()
                child = ctx.Process(target=_child_precisions, args=(queue,))
                child.start()
                child.join(60)
                assert not child.is_alive() and queue.get(timeout=5) == (user, ["ieee", "ieee"], user)
        assert _precisions() == user
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision = backends


@pytest.mark.parametrize("user_setting", ["high", "medium"])
def test_float32_clipped_sums_run_at_highest_precision_whatever_the_user_set(user_setting, monkeypatch):
    """TF32 (CUDA) or bfloat16 (CPU at "medium") would round c_i·L inside the clipped sum's GEMM, and
    a sample could add more than R: the GEMM sees "highest" whatever the user set (observed at the
    call: this CPU gives the same numbers at every setting)."""
    from dpzoo.grad_norms import reps as R

    g = torch.Generator().manual_seed(3)
    rep = R.Factored(torch.randn(4, 1, 6, 300, generator=g), torch.randn(4, 1, 6, 200, generator=g), (200, 300))
    seen, mm = [], torch.mm
    monkeypatch.setattr(torch, "mm", lambda *a, **k: seen.append(_precisions()) or mm(*a, **k))
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(user_setting)
    try:
        R.clipped_sum(rep, torch.rand(4, generator=g))
        assert torch.get_float32_matmul_precision() == user_setting
    finally:
        torch.set_float32_matmul_precision(before)
    assert seen == [["ieee", "ieee"]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bf16 tensor cores)")
@pytest.mark.parametrize("shape", [(8, 256, 512, 384), (4, 197, 768, 3072), (2, 1, 600, 520)])
def test_bf16_factors_on_cuda_are_exact_products_in_float32(shape):
    """The tensor-core path (out_dtype products, the split clipped sum) against float64 on the same
    values, and against the CPU path on the same reps."""
    from dpzoo.grad_norms import reps as R

    b, t, r, c = shape
    rep = _half_rep("cuda", b=b, t=t, r=r, c=c)
    _check_half_rep_against_float64(rep, 1e-5)
    cpu = R.Factored(rep.left.cpu(), rep.right.cpu(), rep.shape)
    torch.testing.assert_close(R.sq_norm(rep, ghost=True).cpu(), R.sq_norm(cpu, ghost=True), rtol=1e-5, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bf16 tensor cores)")
@pytest.mark.parametrize("mode", ["auto", "ghost", "instantiate"])
@pytest.mark.parametrize("case", ["mlp", "gpt2", "resnet18-gn-bias"])
def test_bf16_cuda_autocast_norms_and_sums_are_those_of_the_autocast_model(case, mode):
    """The CPU test above on CUDA, where the factors go through the tensor-core products."""
    _check_autocast_model(case, mode, "cuda")


# -- an independent review's leaks in the half-precision clipped sum, as regression tests ---------


class _UsedTwice(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, 1, bias=False)

    def forward(self, x1, x2):
        return self.lin(x1), self.lin(x2)


@pytest.mark.parametrize("autocast", [True, False])
def test_cancelling_uses_of_one_parameter_share_one_clip_factor(autocast):
    """Two uses of one weight that nearly cancel, one on the ghost path in bf16 (its factor rounded
    to bf16), one instantiated: with different factors their difference (c − c̃)·‖g₁‖, ‖g₁‖ ≈ 2⁸‖g‖,
    was released (1.49 R through make_private). One factor for every use: at most R."""
    d, eps = 64, 2.0**-7
    torch.manual_seed(0)
    model = _UsedTwice(d)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = dpzoo.PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
            data_loader=DataLoader(TensorDataset(torch.zeros(16, 1, d), torch.zeros(16, 128, d)), batch_size=4),
            noise_multiplier=0.0, max_grad_norm=1.0, loss_reduction="sum", mode="bk-mixopt", sample_seed=1,
            self_check=False,
        )  # fmt: skip
    x1, x2 = next(b for b in loader if len(b[0]))
    x1, x2 = torch.zeros_like(x1), torch.zeros_like(x2)
    x1[0, 0] = x2[0, 0] = torch.ones(d)  # one sample, the others 0
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        a, b = model(x1, x2)
    (-(1 - eps) * 15.9375 * a[0, 0].float().sum() + 15.9375 * b[0, 0].float().sum()).backward()
    opt.step()
    released = next(model.parameters()).grad.double().norm().item()
    assert 0.9 < released <= 1.0 + 1e-6


@pytest.mark.parametrize("mode", ["auto", "ghost", "instantiate"])
def test_scaled_factors_that_would_lose_bits_are_summed_exactly(mode):
    """Activations near float32's maximum and a tiny output gradient: c̃·L falls below 2⁻¹¹⁸, where
    the bf16 split is not exact (1.92 R released); such a sum is formed in float64 instead."""
    from dpzoo.grad_norms.half import SPLIT_TINY, scaled_product

    rho, ell = 1.921875 * 2.0**126, 2.0**-72
    model = nn.Linear(256, 64, bias=False)
    x = torch.full((1, 256), rho)
    with attach_norm_hooks(model, mode=mode) as hooks:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        hooks.backward(ell * out.float().sum())
        norm = hooks.per_sample_norms().double()
        released = hooks.clipped_sum((1.0 / norm.clamp(min=1.0)).float())["weight"].double().norm().item()
    true = ell * rho * (64 * 256) ** 0.5
    assert norm.item() >= true and 0.99 < released <= 1.0 + 1e-6
    tiny = torch.full((1, 1, 4), SPLIT_TINY / 4).bfloat16()
    assert scaled_product(tiny, torch.ones(1, 1, 8).bfloat16(), torch.ones(1)) is None
    assert scaled_product(tiny * 8, torch.ones(1, 1, 8).bfloat16(), torch.ones(1)) is not None


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("clip", [1.0, 2.0**-15])
def test_no_sample_leaves_above_r_at_extreme_magnitudes(dtype, clip, groups):
    """The review's sweep: one sample of constant factors, the large one from 2⁶⁰ to float32's maximum,
    ‖g‖ ~ 1e18; float32 lost the scaled factor's bits below its normal range too (1.98 R at R = 2⁻¹⁵).
    ``groups`` 2: a grouped convolution's blocks, the same check."""
    from dpzoo.grad_norms import reps as R
    from dpzoo.grad_norms.param_grad import ParamGrad

    worst = 0.0
    for e in range(60, 128, 3):
        for mantissa in (1.0, 1.5, 1.921875):
            rho = mantissa * 2.0**e
            ell = 2.0 ** round(math.log2(1e18 / (rho * 128)))
            if ell < 2**-126:
                continue
            left = torch.full((1, groups, 1, 64), ell, dtype=dtype)
            rep = R.Factored(left, torch.full((1, groups, 1, 256), rho, dtype=dtype), (groups * 64, 256))
            true = ell * rho * (groups * 64 * 256) ** 0.5  # constant factors: the norm in closed form
            factor = torch.tensor([min(1.0, clip / true)])
            worst = max(worst, ParamGrad([rep], ghost=True).clipped_sum(factor).double().norm().item() / clip)
    assert 0.99 < worst <= 1.0 + 1e-6


class _UnderLinear(nn.Linear):
    """A layer whose registered rule below gives per-sample gradients 4% too small."""


def test_the_self_check_catches_a_four_percent_rule_error_under_bf16_autocast():
    """The self-check compares in float32 with the step's bf16 cotangents; its tolerance stays the
    float32 one (an independent review found a 0.1 bf16 tolerance let this 4% error through)."""
    from dpzoo.grad_norms.rules.linear import linear_rule

    dpzoo.register_rule(_UnderLinear, activation_free={"bias"})(
        lambda module, activations, grad_output, params: linear_rule(module, activations, grad_output * 0.96, params)
    )
    torch.manual_seed(0)
    model = nn.Sequential(_UnderLinear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = dpzoo.PrivacyEngine().make_private(
            module=model, optimizer=opt, data_loader=DataLoader(data, batch_size=32), noise_multiplier=1.0,
            max_grad_norm=1.0, sample_seed=0, noise_seed=0,
        )  # fmt: skip
    x, y = next(iter(loader))
    with pytest.raises(dpzoo.SelfCheckError, match="not the batch gradient"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
