"""dpzoo's DP engine: one step equals the DP-SGD formula by brute force, accounting equals the
library's, Poisson sampling and physical batching, checkpoints, privacy metadata."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from dp_reference import dp_sgd_update
from grad_reference import assert_close
from torch.utils.data import DataLoader, TensorDataset

import dpzoo
from dpzoo.privacy import Accountant, PoissonBatchSampler

R = 0.7
SIGMA = 0.9
SEED = 123


def _resnet():
    torch.manual_seed(0)
    return dpzoo.load("resnet18-gn-bias", num_classes=3, layers=[1, 1, 1, 1], width=4).double().train()


def _data(n=12, size=16):
    g = torch.Generator().manual_seed(5)
    return TensorDataset(
        torch.randn(n, 3, size, size, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)
    )


def _private_sgd(model, ds, batch_size=4):
    """dpzoo's engine on SGD, fixed batches, σ = 1, R = 1: (engine, model, optimizer, loader)."""
    engine = dpzoo.PrivacyEngine()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(ds, batch_size=batch_size),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    return engine, model, opt, loader


def _expected_update(model, x, y, trainable, clipping, reduction, expected_b, lr):
    """The DP-SGD update by brute force, clip weights in closed form (tests/dp_reference.py)."""

    def loss_fn(m, x, y):
        return F.cross_entropy(m(x), y, reduction="sum")

    expected = expected_b if reduction == "mean" else None
    return dp_sgd_update(
        model, loss_fn, {"x": x, "y": y}, x.shape[0], R, SIGMA, SEED, clipping, expected, lr, trainable
    )


@pytest.mark.parametrize("clipping", ["abadi", "automatic"])
@pytest.mark.parametrize("mode", ["auto", "bk", "bk-mixopt", "instantiate", "bitfit"])
def test_one_step_equals_dp_sgd_formula(mode, clipping):
    reduction = "sum" if clipping == "automatic" else "mean"  # cover both reductions
    model, ds, lr = _resnet(), _data(), 0.5
    loader = DataLoader(ds, batch_size=6)
    reference = copy.deepcopy(model)  # brute force on a bare copy
    engine = dpzoo.PrivacyEngine()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model, opt, ploader = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=loader,
        noise_multiplier=SIGMA,
        max_grad_norm=R,
        clipping=clipping,
        mode=mode,
        loss_reduction=reduction,
        noise_seed=SEED,
        sample_seed=1,
    )
    x, y = next(iter(ploader))
    assert 0 < x.shape[0] < len(ds)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    if mode == "bitfit":
        assert all(n.endswith("bias") or n.startswith("fc.") for n in trainable)
        assert "fc.weight" in trainable and "conv1.weight" not in trainable
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    expected = _expected_update(reference, x, y, trainable, clipping, reduction, 6.0, lr)
    loss = F.cross_entropy(model(x), y, reduction=reduction)
    loss.backward()
    opt.step()
    for n, p in model.named_parameters():
        if n in expected:
            assert_close(p.detach() - before[n], expected[n], 1e-6, n)
        else:
            assert torch.equal(p.detach(), before[n]), f"frozen {n} changed"
    assert engine.steps == 1


def test_reported_epsilon_equals_library_accountant():
    from dp_accounting import dp_event
    from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant

    model, ds = _resnet(), _data()
    engine = dpzoo.PrivacyEngine(accountant="rdp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(ds, batch_size=4),
        noise_multiplier=1.1,
        max_grad_norm=1.0,
        sample_seed=0,
    )
    for x, y in loader:
        if x.shape[0]:
            F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    ref = RdpAccountant()
    ref.compose(dp_event.PoissonSampledDpEvent(4 / 12, dp_event.GaussianDpEvent(1.1)), len(loader))
    assert engine.steps == len(loader) == 3
    assert engine.get_epsilon(1e-5) == pytest.approx(ref.get_epsilon(1e-5), rel=1e-12)


def test_target_epsilon_calibrates_noise():
    model, ds = _resnet(), _data(n=40)
    engine = dpzoo.PrivacyEngine()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(ds, batch_size=4),
        target_epsilon=3.0,
        target_delta=1e-5,
        epochs=5,
    )
    a = Accountant("rdp")
    a.step(engine.noise_multiplier, 0.1, 50)
    eps = a.get_epsilon(1e-5)
    assert 2.98 <= eps <= 3.0
    a2 = Accountant("rdp")
    a2.step(engine.noise_multiplier * 0.99, 0.1, 50)
    assert a2.get_epsilon(1e-5) > 3.0  # not over-noised: a little less noise exceeds the target


@pytest.mark.parametrize("name", ["pld", "prv"])
def test_other_accountants_agree_with_their_library(name):
    a = Accountant(name)
    a.step(1.0, 0.02, 100)
    if name == "pld":
        from dp_accounting import dp_event
        from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

        ref = PLDAccountant()
        ref.compose(dp_event.PoissonSampledDpEvent(0.02, dp_event.GaussianDpEvent(1.0)), 100)
        expected = ref.get_epsilon(1e-5)
    else:
        from opacus.accountants import PRVAccountant

        ref = PRVAccountant()
        ref.history = [(1.0, 0.02, 100)]
        expected = ref.get_epsilon(1e-5)
    assert a.get_epsilon(1e-5) == pytest.approx(expected, rel=1e-9)


def test_poisson_sampler_includes_each_sample_with_probability_q():
    g = torch.Generator().manual_seed(0)
    s = PoissonBatchSampler(200, 0.05, steps=400, generator=g)
    batches = list(s)
    sizes = torch.tensor([len(b) for b in batches], dtype=torch.float64)
    counts = torch.zeros(200)
    for b in batches:
        counts[b] += 1
    assert len(batches) == 400
    assert abs(sizes.mean() - 10) < 0.5 and sizes.std() > 1.5  # variable batch size ~ Binomial(200, 0.05)
    assert abs(counts.mean() / 400 - 0.05) < 0.005
    assert all(len(set(b)) == len(b) for b in batches)


def test_empty_poisson_batch_is_a_noise_only_step():
    """The README loop, as written (no `if x.shape[0]`), on a conv model that cannot take 0 rows:
    the loader takes empty Poisson batches itself as noise-only steps."""
    model, ds = _resnet(), _data(n=4)
    engine = dpzoo.PrivacyEngine()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(ds, batch_size=1),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        noise_seed=3,
        sample_seed=0,
    )
    sizes = [len(b) for b in loader.batch_sampler]
    loader.batch_sampler.generator.manual_seed(0)  # rewind: the loop draws these same batches
    assert 0 in sizes
    before = model.fc.bias.detach().clone()
    seen = 0
    for x, y in loader:
        assert x.shape[0] > 0
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        seen += 1
    assert seen == sum(1 for s in sizes if s) < len(sizes)
    assert engine.steps == len(sizes) == 4  # noise-only steps are steps of the mechanism
    assert not torch.equal(before, model.fc.bias.detach())


def test_physical_batches_accumulate_to_the_same_update():
    """A logical batch split into micro-batches gives the same update, with one noise draw."""
    updates = []
    for chunk in (None, 2):
        model, ds = _resnet(), _data(n=20)
        engine = dpzoo.PrivacyEngine()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        model, opt, loader = engine.make_private(
            module=model,
            optimizer=opt,
            data_loader=DataLoader(ds, batch_size=8),
            noise_multiplier=0.5,
            max_grad_norm=R,
            noise_seed=9,
            sample_seed=4,
            max_physical_batch_size=chunk,
        )
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        micro = 0
        for x, y in loader:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            micro += 1
            if engine.steps == 1:
                break
        updates.append(({n: p.detach() - before[n] for n, p in model.named_parameters()}, micro))
    (full, m1), (split, m2) = updates
    assert m1 == 1 and m2 > 1
    for n in full:
        assert_close(split[n], full[n], 1e-9, n)


def test_checkpoint_resumes_accounting(tmp_path):
    model, ds = _resnet(), _data()
    engine = dpzoo.PrivacyEngine()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(ds, batch_size=4),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        target_delta=None,
    )
    for x, y in loader:
        if x.shape[0]:
            F.cross_entropy(model(x), y).backward()
        opt.step()
    torch.save({"engine": engine.state_dict(), "model": model.state_dict()}, tmp_path / "ckpt.pt")
    eps = engine.get_epsilon(1e-5)
    model2 = _resnet()
    engine2 = dpzoo.PrivacyEngine()
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    model2, opt2, loader2 = engine2.make_private(
        module=model2, optimizer=opt2, data_loader=DataLoader(ds, batch_size=4), noise_multiplier=1.0, max_grad_norm=1.0
    )
    engine2.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=False)["engine"])
    assert engine2.steps == 3 and engine2.get_epsilon(1e-5) == eps
    for x, y in loader2:
        if x.shape[0]:
            F.cross_entropy(model2(x), y).backward()
        opt2.step()
    assert engine2.steps == 6 and engine2.get_epsilon(1e-5) > eps


def test_saved_model_carries_privacy_metadata(tmp_path):
    model, ds = _resnet(), _data()
    engine = dpzoo.PrivacyEngine()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(ds, batch_size=4),
        target_epsilon=5.0,
        target_delta=1e-5,
        epochs=1,
    )
    for x, y in loader:
        if x.shape[0]:
            F.cross_entropy(model(x), y).backward()
        opt.step()
    dpzoo.save(model, tmp_path / "m")
    meta = dpzoo.privacy_metadata(tmp_path / "m")
    assert meta["epsilon"] == pytest.approx(engine.get_epsilon(1e-5))
    assert meta["epsilon"] <= 5.0
    assert meta["steps"] == 3 and meta["sample_rate"] == pytest.approx(4 / 12) and meta["accountant"] == "rdp"


def test_bad_arguments_are_explained():
    model, ds = _resnet(), _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(ds, batch_size=4)
    with pytest.raises(dpzoo.DPZooError, match="either noise_multiplier or target_epsilon"):
        dpzoo.PrivacyEngine().make_private(module=model, optimizer=opt, data_loader=loader)
    with pytest.raises(dpzoo.DPZooError, match="target_delta and epochs"):
        dpzoo.PrivacyEngine().make_private(module=model, optimizer=opt, data_loader=loader, target_epsilon=1.0)
    with pytest.raises(dpzoo.DPZooError, match="mode must be"):
        dpzoo.PrivacyEngine().make_private(
            module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0, mode="fast"
        )
    with pytest.raises(dpzoo.DPZooError, match="(?i)unknown"):
        dpzoo.PrivacyEngine(accountant="moments")
    with pytest.raises(ValueError, match="clipping"):
        dpzoo.PrivacyEngine().make_private(
            module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0, clipping="l2"
        )


def test_two_phase_switch_to_bitfit_keeps_accounting():
    model, ds = _resnet(), _data()
    engine = dpzoo.PrivacyEngine()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(ds, batch_size=4),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        noise_seed=0,
    )
    for x, y in loader:
        if x.shape[0]:
            F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    w = model.conv1.weight.detach().clone()
    engine.switch_mode("bitfit")
    assert not model.conv1.weight.requires_grad and model.conv1.bias.requires_grad
    # activation-free everywhere but the trainable head (fc, whose weight needs its input)
    assert [line.split(":")[0] for line in engine.hooks.describe() if line.endswith("(activations)")] == ["fc"]
    assert len(engine.hooks.describe()) > 10  # conv and norm biases: output gradient only
    for x, y in loader:
        if x.shape[0]:
            F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert torch.equal(model.conv1.weight, w)  # no noise on frozen weights
    assert engine.steps == 6 and math.isfinite(engine.get_epsilon(1e-5))


def test_parameter_used_in_the_loss_is_refused():
    """A weight penalty computed from the parameters in the loss is outside the hooks: the
    engine refuses rather than silently dropping its (unclipped) gradient."""
    model, ds = _resnet(), _data()
    engine, model, opt, loader = _private_sgd(model, ds)
    x, y = next(iter(loader))
    (F.cross_entropy(model(x), y) + 1e-3 * model.fc.weight.pow(2).sum()).backward()
    with pytest.raises(dpzoo.UnsupportedModuleError, match="fc.weight received a gradient outside"):
        opt.step()
    # the refused batch is dropped; the usual loop (zero_grad or not) passes: .grad holds only
    # what the optimizer wrote
    opt.zero_grad()
    for i, (x, y) in enumerate(loader):
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert engine.steps >= 2


class _WithUnusedBranch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
        self.scale = torch.nn.Linear(4, 1)

    def forward(self, x):
        with torch.no_grad():  # the classic slip: the path through `scale` is detached
            s = self.scale(x)
        return self.used(x) * s


def test_parameter_without_gradient_warns_once_by_name():
    """Unused or detached trainable parameters get noise only: private, but a silent training bug."""
    torch.manual_seed(0)
    model = _WithUnusedBranch()
    ds = TensorDataset(torch.randn(8, 4), torch.randint(0, 3, (8,)))
    engine, model, opt, loader = _private_sgd(model, ds)
    with pytest.warns(dpzoo.NoGradientWarning) as rec:
        for x, y in loader:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert len(rec) == 1  # once, not every step
    msg = str(rec[0].message)
    for name in ("unused.weight", "unused.bias", "scale.weight", "scale.bias"):
        assert name in msg
    assert "used.weight" not in msg.replace("unused.weight", "")


def test_no_gradient_warning_names_the_line_that_called_step():
    model = _WithUnusedBranch()
    engine, model, opt, loader = _private_sgd(model, TensorDataset(torch.randn(8, 4), torch.randint(0, 3, (8,))))
    x, y = next(iter(loader))
    F.cross_entropy(model(x), y).backward()
    with pytest.warns(dpzoo.NoGradientWarning) as rec:
        opt.step()
    assert rec[0].filename == __file__


@pytest.mark.parametrize("held_by", ["add_noise-wrapper", "scale_grad-override", "replacement-after-a-step", "nothing"])
def test_the_mean_division_leaves_what_an_override_holds_untouched(held_by, monkeypatch):
    """``scale_grad`` divides dpzoo's own noise buffer in place (no second parameter-sized tensor),
    but where an override or a wrapper of ``add_noise`` or ``scale_grad`` (documented override
    points) can hold what add_noise wrote, into new tensors: what it holds stays the noisy sum (an
    independent review's case, 2026-11-27)."""
    from dpzoo.privacy import optimizer as dp_optimizer

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    engine, model, opt, loader = _private_sgd(model, TensorDataset(torch.randn(8, 4), torch.randint(0, 3, (8,))))
    held, written = {}, []
    real_many = dp_optimizer.noised_all_reduce_many
    monkeypatch.setattr(
        dp_optimizer, "noised_all_reduce_many", lambda *a, **k: written.extend(real_many(*a, **k)) or written
    )
    if held_by == "add_noise-wrapper":
        own = opt.add_noise

        def add_noise():
            own()
            held.update({n: (p.grad, p.grad.clone()) for n, p in model.named_parameters()})

        opt.add_noise = add_noise
    elif held_by == "scale_grad-override":

        class Holding(type(opt)):
            def scale_grad(self):
                held.update({n: (p.grad, p.grad.clone()) for n, p in model.named_parameters()})
                super().scale_grad()

        opt.__class__ = Holding
    elif held_by == "replacement-after-a-step":  # installed after a plain step, not calling dpzoo's own
        x, y = next(iter(loader))
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

        def add_noise():  # writes its own tensors (their values do not matter here) and keeps them
            for name, p in model.named_parameters():
                p.grad = torch.randn_like(p)
                held[name] = (p.grad, p.grad.clone())

        opt.add_noise = add_noise
    x, y = next(iter(loader))
    F.cross_entropy(model(x), y).backward()
    opt.step()
    grads = [p.grad for p in model.parameters()]
    if held_by == "nothing":  # the very tensors add_noise wrote, divided where they lie
        assert len(written) == 2 and all(g is w for g, w in zip(grads, written))
        return
    for n, p in model.named_parameters():
        tensor, values = held[n]
        assert tensor is not p.grad
        assert torch.equal(tensor, values)  # untouched
        torch.testing.assert_close(p.grad, values / opt.expected_batch_size)


def test_no_gradient_warning_stays_quiet_when_everything_trains(recwarn):
    model, ds = _resnet(), _data()
    engine, model, opt, loader = _private_sgd(model, ds)
    x, y = next(iter(loader))
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert not [w for w in recwarn if issubclass(w.category, dpzoo.NoGradientWarning)]
