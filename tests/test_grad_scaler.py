"""Float16 loss scaling through dpzoo.DPGradScaler (dpzoo/privacy/grad_scaler.py).

* The scale divides out exactly: a power-of-two scale gives the same update, bit for bit, as no
  scale, in every training mode (norms and the book-kept sum are linear in the loss).
* A sample whose scaled gradient is not finite contributes exactly 0 and the step is taken: the
  update is the DP-SGD formula over the other samples, from a float64 brute-force reference.
* Under float16 autocast the update matches the float64 reference to FP16_TOL (float16 keeps 11
  significant bits; the norms and sums are formed in float32 from what the float16 layers computed).
* torch's GradScaler stays refused; misuse of the DP scaler gets a one-line DPZooError.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from dp_reference import clip_weights, seeded_noise
from grad_reference import assert_close
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpzoo
from dpzoo.errors import InvalidArgumentError, PrivacyUsageError

FP16_TOL = 1e-2
SIGMA, R, LR = 0.7, 0.5, 0.2


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))


def tiny_lm(seed=0):
    """Embedding + tied output projection: the Phantom Clipping cross term is in the scaled sums."""
    torch.manual_seed(seed)
    card = dpzoo.model_card("gpt2")
    return dpzoo.load("gpt2", **card.test_overrides).float()


def make_private(model, ds, mode="bk-mixopt", reduction="sum", **kw):
    engine = dpzoo.PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        data_loader=DataLoader(ds, batch_size=8),
        noise_multiplier=SIGMA,
        max_grad_norm=R,
        loss_reduction=reduction,
        noise_seed=5,
        sample_seed=6,
        mode=mode,
        **kw,
    )
    return engine, model, opt, loader


def mlp_data(n=40, seed=3):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 10, generator=g), torch.randint(0, 4, (n,), generator=g))


def mlp_loss(model, x, y, reduction="sum"):
    return F.cross_entropy(model(x), y, reduction=reduction)


def lm_loss(model, ids, reduction="sum"):
    logits = model(input_ids=ids).logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction=reduction)


def one_step(case, mode, scale):
    """The parameters after one DP step, with ``DPGradScaler(scale)`` or (scale None) without one."""
    if case == "mlp":
        model, ds, loss = mlp(), mlp_data(), mlp_loss
    else:
        model = tiny_lm()
        vocab = model.config.vocab_size
        ds, loss = TensorDataset(torch.randint(0, vocab, (40, 12), generator=torch.Generator().manual_seed(4))), lm_loss
    engine, model, opt, loader = make_private(model, ds, mode=mode, reduction="mean")
    scaler = dpzoo.DPGradScaler(opt, scale) if scale is not None else None
    batch = next(iter(loader))
    out = loss(model, *batch, reduction="mean")
    (scaler.scale(out) if scaler else out).backward()
    scaler.step(opt) if scaler else opt.step()
    assert engine.steps == 1 and engine.self_check_result.startswith("passed")
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["bk-mixopt", "bk", "instantiate", "bitfit"])
@pytest.mark.parametrize("case", ["mlp", "lm"])
def test_a_power_of_two_scale_divides_out_exactly(case, mode):
    plain = one_step(case, mode, None)
    for scale in (2.0**10, 2.0**20):
        scaled = one_step(case, mode, scale)
        assert all(torch.equal(a, b) for a, b in zip(plain, scaled)), f"scale {scale} changed the update"
    # and the test can fail: a scale the optimizer is not told about changes the update
    assert not all(torch.equal(a, b) for a, b in zip(plain, _unannounced(case, mode)))


def _unannounced(case, mode):
    """One step whose loss was multiplied by 2⁻¹² without telling the optimizer (a factor that
    brings samples under R: Abadi clipping of samples all above R is invariant to any factor)."""
    model, ds, loss = (mlp(), mlp_data(), mlp_loss) if case == "mlp" else (None, None, None)
    if model is None:
        model = tiny_lm()
        vocab = model.config.vocab_size
        ds, loss = TensorDataset(torch.randint(0, vocab, (40, 12), generator=torch.Generator().manual_seed(4))), lm_loss
    _, model, opt, loader = make_private(model, ds, mode=mode, reduction="mean")
    (2.0**-12 * loss(model, *next(iter(loader)), reduction="mean")).backward()
    opt.step()
    return [p.detach().clone() for p in model.parameters()]


def expected_update(model64, x, y, keep, noise_params):
    """-lr · (Σ_{i kept} C_i g_i + noise) from float64 per-sample backward passes; the noise from
    the generator the engine seeds with noise_seed=5, drawn per parameter in order."""
    grads = [
        torch.autograd.grad(mlp_loss(model64, x[i : i + 1].double(), y[i : i + 1]), model64.parameters()) for i in keep
    ]
    norms = torch.stack([torch.sqrt(sum(t.pow(2).sum() for t in gi)) for gi in grads])
    c = clip_weights(norms, R, "abadi")
    gen = torch.Generator().manual_seed(5)
    noise = seeded_noise(list(noise_params), SIGMA * R, gen)
    return [-LR * (sum(c[j] * grads[j][k] for j in range(len(keep))).float() + noise[k]) for k in range(len(noise))]


def test_a_sample_whose_gradient_overflows_contributes_zero():
    model = mlp()
    model64 = copy.deepcopy(model).double()
    engine, model, opt, loader = make_private(model, mlp_data(), self_check=False)  # sample 0 is inf in forward too
    scaler = dpzoo.DPGradScaler(opt, 2.0**4)
    x, y = next(iter(loader))
    assert len(y) >= 3
    x = x.clone()
    x[0] = float("inf")  # its loss, activations and output gradients are not finite
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    expected = expected_update(model64, x, y, range(1, len(y)), params)
    scaler.scale(mlp_loss(model, x, y)).backward()
    scaler.step(opt)
    assert engine.steps == 1 and scaler.nonfinite_samples == 1
    for p, b0, e in zip(params, before, expected):
        assert torch.isfinite(p).all()
        assert_close(p.detach() - b0, e, 1e-4, floor=max(t.abs().max() for t in expected))


def test_without_the_dp_scaler_a_non_finite_sample_is_still_refused():
    engine, model, opt, loader = make_private(mlp(), mlp_data(), self_check=False)
    x, y = next(iter(loader))
    x = x.clone()
    x[0] = float("nan")
    mlp_loss(model, x, y).backward()
    with pytest.raises(PrivacyUsageError, match="non-finite gradient"):
        opt.step()
    assert engine.steps == 0


def test_float16_autocast_step_matches_a_float64_reference():
    model = mlp()
    model64 = copy.deepcopy(model).double()
    engine, model, opt, loader = make_private(model, mlp_data())
    scaler = dpzoo.DPGradScaler(opt)
    x, y = next(iter(loader))
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    expected = expected_update(model64, x, y, range(len(y)), params)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = mlp_loss(model, x, y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert engine.steps == 1 and scaler.nonfinite_samples == 0 and scaler.get_scale() == 2.0**12
    assert engine.self_check_result.startswith("passed")
    for p, b0, e in zip(params, before, expected):
        assert_close(p.detach() - b0, e, FP16_TOL, floor=max(t.abs().max() for t in expected))


def test_float16_overflow_of_one_sample_drops_it_and_steps():
    """A sample with 1000x larger inputs has saturated logits, so its output gradient is ±1 and,
    times 2^16, overflows float16 (max 65504), while the others' (|∂L/∂logit| < 1) fit: it is
    dropped (its contribution 0), the step is taken, and the self-check (float32) still passes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.GELU(), nn.Linear(32, 4))  # no LayerNorm to tame sample 0
    model64 = copy.deepcopy(model).double()
    engine, model, opt, loader = make_private(model, mlp_data())
    scaler = dpzoo.DPGradScaler(opt, 2.0**16)
    x, y = next(iter(loader))
    x = x.clone()
    x[0] *= 1e3
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = mlp_loss(model, x, y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    assert engine.steps == 1 and scaler.nonfinite_samples == 1  # sample 0 alone
    assert engine.self_check_result.startswith("passed")
    expected = expected_update(model64, x, y, range(1, len(y)), params)
    for p, b0, e in zip(params, before, expected):
        assert torch.isfinite(p).all()
        assert_close(p.detach() - b0, e, FP16_TOL, floor=max(t.abs().max() for t in expected))


def test_torch_grad_scaler_is_refused_and_names_the_dp_one():
    engine, model, opt, loader = make_private(mlp(), mlp_data())
    scaler = torch.amp.GradScaler("cpu")
    x, y = next(iter(loader))
    scaler.scale(mlp_loss(model, x, y)).backward()
    with pytest.raises(PrivacyUsageError, match="DPGradScaler"):
        scaler.step(opt)
    assert engine.steps == 0


def test_scaler_misuse_gets_clear_errors():
    model = mlp()
    with pytest.raises(PrivacyUsageError, match="DPOptimizer"):
        dpzoo.DPGradScaler(torch.optim.SGD(model.parameters(), lr=0.1))
    _, model, opt, loader = make_private(model, mlp_data())
    for bad in (0, -1.0, 0.5, 1e-30, 2.0**25, float("inf"), float("nan"), True, "x"):
        with pytest.raises(InvalidArgumentError, match=r"in \[1, 2\*\*24\]"):
            dpzoo.DPGradScaler(opt, bad)
    scaler = dpzoo.DPGradScaler(opt, 8.0)
    with pytest.raises(PrivacyUsageError, match="unscale_"):
        scaler.unscale_(opt)
    _, _, other, _ = make_private(mlp(), mlp_data())
    with pytest.raises(PrivacyUsageError, match="another optimizer"):
        scaler.step(other)
    opt.loss_scale = 1.0
    with pytest.raises(InvalidArgumentError, match="scale"):
        scaler.scale("loss")
    assert opt.loss_scale == 1.0  # a refused call leaves the optimizer as it was
    scaler.update()
    assert scaler.get_scale() == 8.0  # never moves on its own
    scaler.update(torch.tensor(4.0))
    assert scaler.get_scale() == 4.0
    state = scaler.state_dict()
    fresh = dpzoo.DPGradScaler(opt)
    fresh.load_state_dict(state)
    assert fresh.get_scale() == 4.0
    with pytest.raises(InvalidArgumentError, match="state dict"):
        fresh.load_state_dict({})


def test_a_disabled_scaler_passes_through():
    engine, model, opt, loader = make_private(mlp(), mlp_data())
    scaler = dpzoo.DPGradScaler(opt, enabled=False)
    x, y = next(iter(loader))
    loss = mlp_loss(model, x, y)
    assert scaler.scale(loss) is loss and scaler.get_scale() == 1.0 and not opt.drop_nonfinite
    loss.backward()
    scaler.step(opt)
    assert engine.steps == 1 and opt.loss_scale == 1.0


def crafted_step(flow, dtype, scale, r=0.01, d=16, t=100):
    """One DP step on a batch whose sample 0 has tiny activations (‖x_t‖ = 1e-4: their float16 Gram
    entries, 1e-8, round to 0) and the others zero gradient; the released sum is sample 0's
    contribution. ``flow``: where the clipping runs relative to the user's autocast block."""
    torch.manual_seed(0)
    model = nn.Linear(d, d, bias=False)
    ds = TensorDataset(torch.zeros(32, t, d), torch.zeros(32, t, d))
    engine = dpzoo.PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(ds, batch_size=8),
        noise_multiplier=0.0,
        max_grad_norm=r,
        loss_reduction="sum",
        mode="bk",
        sample_seed=1,
        self_check=False,
    )
    scaler = dpzoo.DPGradScaler(opt, scale, enabled=dtype == torch.float16)
    x, y = next(b for b in loader if len(b[0]) >= 2)
    first = torch.zeros(len(x), 1, 1)
    first[0] = 1  # sample 0 alone; built from the batch's rows (a write into them by position is refused)
    x, y = x * 0 + first * (1e-4 / d**0.5), y * 0 + first * (200.0 / scale / d**0.5)

    def loss(sl):
        return scaler.scale((model(x[sl]).float() * y[sl]).sum())

    everything = slice(None)
    if flow == "outside":
        with torch.autocast("cpu", dtype=dtype):
            out = loss(everything)
        out.backward()
        scaler.step(opt)
    elif flow == "step inside":
        with torch.autocast("cpu", dtype=dtype):
            loss(everything).backward()
            scaler.step(opt)
    else:  # gradient accumulation: the second forward (under autocast) clips the first micro-batch
        for sl in (slice(0, 1), slice(1, None)):
            with torch.autocast("cpu", dtype=dtype):
                out = loss(sl)
            out.backward()
        scaler.step(opt)
    return model.weight.grad.detach().clone()


@pytest.mark.parametrize("flow", ["step inside", "accumulate"])
@pytest.mark.parametrize("dtype,scale", [(torch.float16, 16.0), (torch.bfloat16, 1.0)])
def test_clipping_inside_the_users_autocast_runs_in_float32(flow, dtype, scale):
    """Norms and clipped sums never run under the user's autocast (grad_norms/autocast.py): in float16
    the tiny sample's Gram underflowed to 0 there, its norm read 0 and it was released unclipped
    (12.5 R). Now every flow gives the reference flow's update, and the contribution is at most R."""
    r = 0.01
    reference = crafted_step("outside", dtype, scale, r)
    got = crafted_step(flow, dtype, scale, r)
    assert 0 < reference.norm() <= r * (1 + 1e-5)
    assert_close(got, reference, 1e-5, flow)


def test_torch_grad_scaler_is_refused_even_after_unscale():
    engine, model, opt, loader = make_private(mlp(), mlp_data())
    scaler = torch.amp.GradScaler("cpu")
    x, y = next(iter(loader))
    scaler.scale(mlp_loss(model, x, y)).backward()
    scaler.unscale_(opt)  # then GradScaler hands step() no grad_scale, only found_inf
    with pytest.raises(PrivacyUsageError, match="DPGradScaler"):
        scaler.step(opt)
    assert engine.steps == 0


def test_a_nan_sample_in_the_first_batch_fails_the_self_check_with_its_cause():
    from dpzoo.errors import SelfCheckError

    engine, model, opt, loader = make_private(mlp(), mlp_data())
    scaler = dpzoo.DPGradScaler(opt)
    x, y = next(iter(loader))
    x = x.clone()
    x[1] = float("inf")
    scaler.scale(mlp_loss(model, x, y)).backward()
    with pytest.raises(SelfCheckError, match=r"gives NaN for sample\(s\) \[1\].*Clean the data"):
        scaler.step(opt)
    assert engine.steps == 0


def test_the_scale_applies_to_the_micro_batch_it_was_given_to_only():
    """After a scaled step, a plain loss.backward() is not divided by the old scale."""
    plain_model, scaled_model = mlp(), mlp()
    ds = mlp_data()
    runs = []
    for model, use_scaler in ((plain_model, False), (scaled_model, True)):
        engine, model, opt, loader = make_private(model, ds)
        scaler = dpzoo.DPGradScaler(opt, 2.0**8) if use_scaler else None
        batches = iter(loader)
        x, y = next(batches)
        (scaler.scale(mlp_loss(model, x, y)) if scaler else mlp_loss(model, x, y)).backward()
        opt.step()
        assert opt.loss_scale == 1.0
        x, y = next(batches)
        mlp_loss(model, x, y).backward()  # no scaler this time
        opt.step()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
