"""The guarantee holds at the edges (issue 13): each ordinary use either gets a correct guarantee
or a DPZooError naming what to change. Every test here failed on the engine before this issue
(the comment says what happened then), and goes through the public API as a user would."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from dp_reference import dp_sgd_update
from grad_reference import assert_close
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpzoo
from dpzoo.errors import PrivacyUsageError, ReproducibleNoiseWarning, SelfCheckError, UnsupportedModuleError
from dpzoo.grad_norms.hooks import attached_norm_hooks


def _mlp(d=5, c=3, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, 8), nn.Tanh(), nn.Linear(8, c)).double()


def _ds(n=12, d=5, c=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, d, generator=g, dtype=torch.float64), torch.randint(0, c, (n,), generator=g))


def _private(model, ds, batch_size=4, opt=None, **kw):
    engine = dpzoo.PrivacyEngine()
    opt = opt if opt is not None else torch.optim.SGD(model.parameters(), lr=0.5)
    kw.setdefault("noise_multiplier", 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReproducibleNoiseWarning)
        model, opt, loader = engine.make_private(
            module=model, optimizer=opt, data_loader=DataLoader(ds, batch_size=batch_size), **kw
        )
    return engine, model, opt, loader


def _dp_update(model, x, y, R, sigma, seed, reduction="sum", lr=0.5, expected=None):
    """The DP-SGD update by brute force (single-sample backward passes, closed-form clipping)."""
    loss_i = lambda m, x, y: F.cross_entropy(m(x), y, reduction="sum")
    expected = expected if reduction == "mean" else None
    return dp_sgd_update(model, loss_i, {"x": x, "y": y}, x.shape[0], R, sigma, seed, "abadi", expected, lr)


# -- 1. parameters outside the model ------------------------------------------------------------
def test_optimizer_holding_a_head_outside_the_model_is_refused():
    """Before: the head was updated with its raw gradient (no clipping, no noise), ε reported."""
    body, head = _mlp(), nn.Linear(3, 2).double()
    opt = torch.optim.SGD(list(body.parameters()) + list(head.parameters()), lr=0.1)
    with pytest.raises(PrivacyUsageError, match=r"2 trainable parameter\(s\) that are not in the model"):
        _private(body, _ds(), opt=opt)
    assert attached_norm_hooks(body) is None  # nothing left attached


def test_optimizer_over_another_models_parameters_is_refused():
    """Before: trained nothing, spent ε."""
    model, other = _mlp(), _mlp(seed=1)
    with pytest.raises(PrivacyUsageError, match="not in the model"):
        _private(model, _ds(), opt=torch.optim.SGD(other.parameters(), lr=0.1))


def test_optimizer_missing_a_trainable_parameter_is_refused():
    model = _mlp()
    with pytest.raises(PrivacyUsageError, match=r"Trainable parameter\(s\) 2.bias .*not in the optimizer"):
        _private(model, _ds(), opt=torch.optim.SGD([p for n, p in model.named_parameters() if n != "2.bias"], lr=0.1))


def test_parameter_group_added_after_make_private_is_refused_at_step():
    model, head = _mlp(), nn.Linear(3, 3).double()
    engine, model, opt, loader = _private(model, _ds())
    opt.add_param_group({"params": head.parameters()})
    x, y = next(b for b in loader if len(b[1]))  # an empty Poisson batch (about 1 draw in 130 here) has no loss
    F.cross_entropy(model(x), y).backward()
    for p in head.parameters():  # however it got there: a gradient dpzoo did not clip
        p.grad = torch.ones_like(p)
    with pytest.raises(PrivacyUsageError, match="does not clip"):
        opt.step()
    assert engine.steps == 0


def test_a_head_outside_the_model_is_refused_where_it_meets_the_outputs():
    model, head = _mlp(), nn.Linear(3, 3).double()
    engine, model, opt, loader = _private(model, _ds())
    x, y = next(iter(loader))
    with pytest.raises(UnsupportedModuleError, match="outside the private model meets its outputs"):
        head(model(x))


# -- 3. modules that mix samples ------------------------------------------------------------------
@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.BatchNorm1d(8, affine=False),
        lambda: _frozen(nn.BatchNorm1d(8)),
        lambda: nn.SyncBatchNorm(8, affine=False),
    ],
    ids=["bn-no-affine", "bn-frozen-affine", "syncbn"],
)
def test_batchnorm_without_trainable_parameters_is_refused(make):
    """Before: accepted; per-sample norms depended on other samples, running stats released."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), make(), nn.Tanh(), nn.Linear(8, 3)).double()
    with pytest.raises(PrivacyUsageError, match="mix samples"):
        _private(model, _ds())


def _frozen(m):
    for p in m.parameters():
        p.requires_grad_(False)
    return m


class _RunningMean(nn.Module):
    """A custom layer with running statistics updated from the batch (no BatchNorm involved)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 3)
        self.register_buffer("running", torch.zeros(5))

    def forward(self, x):
        if self.training:
            self.running.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return self.lin(x - self.running)


def test_buffer_updated_from_the_batch_is_refused():
    engine, model, opt, loader = _private(_RunningMean().double(), _ds())
    x, y = next(iter(loader))
    with pytest.raises(PrivacyUsageError, match=r"Buffer\(s\) running changed"):
        model(x)


def test_batchnorm_in_eval_mode_and_frozen_is_accepted():
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(8)
    model = nn.Sequential(nn.Linear(5, 8), _frozen(bn), nn.Tanh(), nn.Linear(8, 3)).double()
    bn.eval()
    engine, model, opt, loader = _private(model, _ds())
    for x, y in loader:
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert engine.steps == 3


# -- 4. batch not in dimension 0 ------------------------------------------------------------------
class _TimeMajor(nn.Module):
    """A recurrent model that takes (T, B, D), as torch's RNNs do by default."""

    def __init__(self, d=5, h=6, c=3):
        super().__init__()
        self.ih, self.hh, self.out = nn.Linear(d, h), nn.Linear(h, h), nn.Linear(h, c)

    def forward(self, x):  # (T, B, D) -> (B, C)
        h = torch.zeros(x.shape[1], self.hh.in_features, dtype=x.dtype)
        for t in range(x.shape[0]):
            h = torch.tanh(self.ih(x[t]) + self.hh(h))
        return self.out(h)


def test_time_major_model_is_refused():
    """Before: clipped per time step (T rows) and accepted."""
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(12, 7, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (12,), generator=g))
    # q = 1: B = 12 != T = 7 every step (T == B is the self-check's case, switched off here)
    engine, model, opt, loader = _private(_TimeMajor().double(), ds, batch_size=12, self_check=False)
    with pytest.raises((PrivacyUsageError, dpzoo.UnsupportedModuleError), match="rows|batch"):
        for x, y in loader:
            F.cross_entropy(model(x.transpose(0, 1)), y).backward()
            opt.step()
    assert engine.steps == 0


# -- 5. the first-step self-check ------------------------------------------------------------------
class _TimeMajorOut(_TimeMajor):
    def forward(self, x):  # (T, B, D) -> (T, B, C): one output per time step
        h = torch.zeros(x.shape[1], self.hh.in_features, dtype=x.dtype)
        outs = []
        for t in range(x.shape[0]):
            h = torch.tanh(self.ih(x[t]) + self.hh(h))
            outs.append(self.out(h))
        return torch.stack(outs)


def test_self_check_catches_time_major_with_T_equal_B():
    """T == B: every shape check passes. Before: silently clipped time steps, not samples."""
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(6, 6, 5, generator=g, dtype=torch.float64))  # (B, T, D), fed as (T, B, D)
    engine, model, opt, loader = _private(_TimeMajorOut().double(), ds, batch_size=6)  # q = 1: B = T = 6
    before = copy.deepcopy(model.state_dict())
    (x,) = next(iter(loader))
    model(x.transpose(0, 1)).pow(2).mean().backward()
    with pytest.raises(SelfCheckError):
        opt.step()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # nothing released
    assert engine.steps == 0


class _Permuting(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h.roll(1, 0))  # sample i's output comes from sample i-1's features


def test_self_check_catches_samples_permuted_inside_forward():
    engine, model, opt, loader = _private(_Permuting().double(), _ds(), batch_size=12)
    x, y = next(iter(loader))
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(SelfCheckError, match="independently"):
        opt.step()


class _StandardisedConv(nn.Conv2d):
    """Weight standardisation inside _conv_forward: the plain Conv2d rule would be wrong."""

    def _conv_forward(self, x, weight, bias):
        w = (weight - weight.mean((1, 2, 3), keepdim=True)) / (weight.std((1, 2, 3), keepdim=True) + 1e-5)
        return super()._conv_forward(x, w, bias)


def test_overridden_conv_forward_is_refused():
    """Before: silently inherited the Conv2d rule (wrong per-sample norms)."""
    torch.manual_seed(0)
    model = nn.Sequential(_StandardisedConv(2, 3, 3), nn.Flatten(), nn.Linear(3 * 4 * 4, 3)).double()
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(
        torch.randn(8, 2, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)
    )
    with pytest.raises(dpzoo.UnsupportedModuleError, match=r"_StandardisedConv overrides the _conv_fo"):
        engine, model, opt, loader = _private(model, ds, batch_size=8)
        x, y = next(iter(loader))
        F.cross_entropy(model(x), y).backward()
        opt.step()


def test_replaced_instance_forward_is_refused():
    torch.manual_seed(0)
    model = _mlp()
    lin = model[0]
    lin.forward = lambda x: F.linear(x, lin.weight * 2, lin.bias)  # computes 2·W x: the Linear rule is wrong
    with pytest.raises(dpzoo.UnsupportedModuleError, match="its forward was replaced on the instance"):
        engine, model, opt, loader = _private(model, _ds(), batch_size=12)
        x, y = next(iter(loader))
        F.cross_entropy(model(x), y).backward()
        opt.step()


def test_self_check_passes_and_is_recorded_or_opted_out():
    engine, model, opt, loader = _private(_mlp(), _ds(), batch_size=12, target_delta=1e-5)
    x, y = next(iter(loader))
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert engine.privacy_metadata()["self_check"].startswith("passed")
    engine2, model2, opt2, loader2 = _private(_mlp(), _ds(), self_check=False, target_delta=1e-5)
    assert "skipped by the user" in engine2.privacy_metadata()["self_check"]


def test_self_check_catches_a_bug_in_the_norms_the_step_clips_by(monkeypatch):
    """The step clips by per_sample_norms(), which takes its own path (small parameters normed as one
    row); the self-check verifies the per-parameter norms against single-sample passes and that the
    clipping path's totals are their sum: a bug there alone (norms 2x too small) refuses the step."""
    from dpzoo.grad_norms import hooks as hooks_module

    real = hooks_module.total_sq_norms
    monkeypatch.setattr(hooks_module, "total_sq_norms", lambda grads: [s / 4 for s in real(grads)])
    engine, model, opt, loader = _private(_mlp(), _ds(), batch_size=12)
    x, y = next(iter(loader))
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(SelfCheckError, match="total per-sample norms"):
        opt.step()
    assert engine.steps == 0


def test_the_clipping_paths_check_accepts_a_sample_whose_gradient_underflows():
    """A confidently classified sample (logit margin ~70: cross-entropy gradient ~1e-30, float32
    squared norms subnormal) has norms that are rounding allowances (a float32 bound rounds up to
    at least 2⁻¹⁴⁹), far above its exact norms in relative terms: neither the clipping path's check
    nor the single-sample comparison may refuse it (found by a review; the second was older)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(8, 4) * 0.3
    y = torch.tensor([0, 1] * 4)
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].weight[:, 0] = 1.0
        model[0].bias.zero_()
        model[2].weight.copy_(torch.tensor([[-4.4] * 8, [4.4] * 8]))
        model[2].bias.zero_()
    # sample 1 is not among those compared alone (0, 4, 7), sample 0 is: with y[0] = 1 its margin is ~70 too
    for tiny, label in ((1, 1), (0, 1)):
        xs, ys = x.clone(), y.clone()
        xs[tiny, 0], ys[tiny] = 5.0, label
        report = dpzoo.verify(model, xs, lambda out, ys=ys: F.cross_entropy(out, ys, reduction="sum"))
        assert report.samples == [0, 4, 7]


def test_verify_public_api():
    model = _mlp()
    x, y = _ds().tensors
    report = dpzoo.verify(model, x, lambda out: F.cross_entropy(out, y, reduction="sum"))
    assert max(report.worst.values()) < 1e-9
    with pytest.raises(SelfCheckError):
        dpzoo.verify(_Permuting().double(), x, lambda out: F.cross_entropy(out, y, reduction="sum"))


# -- 8. sampling ----------------------------------------------------------------------------------
def test_fixed_batches_are_refused():
    """Before: poisson_sampling=False was accounted as Poisson (5.89 reported, 12.30 for the mechanism)."""
    with pytest.raises(PrivacyUsageError, match="poisson_sampling=False"):
        _private(_mlp(), _ds(), poisson_sampling=False)


def test_iterating_the_original_loader_is_refused():
    """Before: batches of the original loader were accounted as Poisson batches."""
    model, ds = _mlp(), _ds()
    original = DataLoader(ds, batch_size=4)
    engine = dpzoo.PrivacyEngine()
    model, opt, dp_loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=original, noise_multiplier=1.0
    )
    x, y = next(iter(original))
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(PrivacyUsageError, match="returned loader"):
        opt.step()


# -- 9. secret randomness ---------------------------------------------------------------------------
def _one_update(seed_everything):
    torch.manual_seed(seed_everything)
    model, ds = _mlp(), _ds(n=4)
    engine = dpzoo.PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(ds, batch_size=4),
        noise_multiplier=1.0,
    )
    before = [p.detach().clone() for p in model.parameters()]
    x, y = next(iter(loader))
    F.cross_entropy(model(x), y).backward()
    opt.step()
    return torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)]), engine, opt


def test_noise_is_secret_by_default():
    """Before: noise seeded from torch's global RNG: two runs after manual_seed(1234) were identical."""
    a, engine, opt = _one_update(1234)
    b, _, _ = _one_update(1234)
    assert not torch.equal(a, b)
    state = engine.state_dict()
    assert "generators" not in state["optimizer"] and "noise_seed" not in state["optimizer"]
    assert engine.privacy_metadata(1e-5)["noise"].startswith("secret")


def test_reproducible_noise_warns_and_is_recorded():
    model = _mlp()
    engine = dpzoo.PrivacyEngine()
    with pytest.warns(ReproducibleNoiseWarning, match="noise_seed=7"):
        engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=DataLoader(_ds(), batch_size=4),
            noise_multiplier=1.0,
            noise_seed=7,
        )
    assert engine.privacy_metadata(1e-5)["noise"].startswith("reproducible (not private")
    assert "generators" in engine.state_dict()["optimizer"]


def test_dpzoo_train_twice_with_the_default_seed_gives_different_models(tmp_path):
    """Before: `dpzoo train` with its default --seed 0 produced two bit-identical private models."""
    from dpzoo.runs.classifier import train_image_classifier

    outs = []
    for k in range(2):
        train_image_classifier(
            "resnet18-gn-bias",
            epochs=1,
            batch_size=256,
            image_size=8,
            out=tmp_path / str(k),
            overrides={"width": 4, "layers": [1, 1, 1, 1]},
            log=lambda *a: None,
        )
        outs.append(dpzoo.load(tmp_path / str(k) / "model"))
    w = [dict(m.named_parameters())["fc.weight"].detach() for m in outs]
    assert not torch.equal(w[0], w[1])
    assert dpzoo.privacy_metadata(tmp_path / "0" / "model")["noise"].startswith("secret")


# -- 10. gradient accumulation -----------------------------------------------------------------------
def test_micro_batches_before_one_step_accumulate_exactly():
    """Two forward/backward passes on halves of one logical batch, one step() (before: the first
    half was silently dropped). Equals the DP-SGD update on the whole batch, by brute force."""
    R, sigma, seed = 0.3, 0.7, 11
    model, ds = _mlp(), _ds(n=8)
    reference = _mlp()
    engine, model, opt, loader = _private(
        model, ds, batch_size=8, max_grad_norm=R, noise_multiplier=sigma, noise_seed=seed, loss_reduction="sum"
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = next(iter(loader))  # q = 1: all 8
    for half in (slice(0, 5), slice(5, 8)):
        F.cross_entropy(model(x[half]), y[half], reduction="sum").backward()
    opt.step()
    expected = _dp_update(reference, x, y, R, sigma, seed)
    for n, p in model.named_parameters():
        assert_close(p.detach() - before[n], expected[n], 1e-9, n)
    assert engine.steps == 1


def test_two_logical_batches_before_one_step_are_refused():
    engine, model, opt, loader = _private(_mlp(), _ds(n=40), batch_size=10)
    it = iter(loader)
    x1, y1 = next(it)
    F.cross_entropy(model(x1), y1).backward()
    x2, y2 = next(it)
    with pytest.raises(PrivacyUsageError, match="two different logical batches"):
        F.cross_entropy(model(x2), y2).backward()
        opt.step()


def test_same_batch_twice_before_one_step_is_refused():
    engine, model, opt, loader = _private(_mlp(), _ds(n=40), batch_size=10)
    x, y = next(iter(loader))
    for _ in range(2):
        F.cross_entropy(model(x), y).backward()
    with pytest.raises(PrivacyUsageError, match=r"clipped \d+ rows but the loader's logical batch has"):
        opt.step()


def test_second_step_on_the_same_batch_is_refused():
    engine, model, opt, loader = _private(_mlp(), _ds(n=40), batch_size=10)
    x, y = next(iter(loader))
    F.cross_entropy(model(x), y).backward()
    opt.step()
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(PrivacyUsageError, match="second optimizer.step"):
        opt.step()


# -- 11. freezing after make_private ----------------------------------------------------------------
def test_freezing_after_make_private_is_respected():
    """Before: the frozen parameter kept receiving clipped gradient plus noise."""
    engine, model, opt, loader = _private(_mlp(), _ds(n=40), batch_size=10)
    model[0].weight.requires_grad_(False)
    w = model[0].weight.detach().clone()
    for x, y in loader:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert torch.equal(model[0].weight, w) and engine.steps == 4
    assert "0.weight" not in engine.hooks.trainable_parameters  # re-planned: not clipped any more


def test_unfreezing_after_make_private_trains_privately():
    model = _mlp()
    model[0].weight.requires_grad_(False)
    engine, model, opt, loader = _private(
        model, _ds(n=40), batch_size=10, opt=torch.optim.SGD(model.parameters(), lr=0.5)
    )
    model[0].weight.requires_grad_(True)
    x, y = next(iter(loader))
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert "0.weight" in engine.hooks.trainable_parameters
    assert engine.optimizer.last_per_sample_norms is not None


# -- 12. arguments -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_physical_batch_size": -4}, "max_physical_batch_size must be a positive integer"),
        ({"max_physical_batch_size": 0}, "max_physical_batch_size must be a positive integer"),
        ({"max_physical_batch_size": 2.5}, "max_physical_batch_size must be a positive integer"),
        (
            {"target_epsilon": 0.0, "target_delta": 1e-5, "epochs": 1, "noise_multiplier": None},
            "target_epsilon must be",
        ),
        (
            {"target_epsilon": -1.0, "target_delta": 1e-5, "epochs": 1, "noise_multiplier": None},
            "target_epsilon must be",
        ),
        (
            {"target_epsilon": float("nan"), "target_delta": 1e-5, "epochs": 1, "noise_multiplier": None},
            "target_epsilon must be",
        ),
        (
            {"target_epsilon": 1.0, "target_delta": 1.0, "epochs": 1, "noise_multiplier": None},
            "target_delta must be in",
        ),
        (
            {"target_epsilon": 1.0, "target_delta": 0.0, "epochs": 1, "noise_multiplier": None},
            "target_delta must be in",
        ),
        ({"target_epsilon": 1.0, "target_delta": 1e-5, "epochs": 0, "noise_multiplier": None}, "epochs must be"),
        ({"noise_multiplier": -1.0}, "noise_multiplier must be"),
        ({"max_grad_norm": 0.0}, "max_grad_norm must be"),
        ({"clipping": "l2"}, "clipping must be"),
        ({"loss_reduction": "none"}, "loss_reduction must be"),
        ({"noise_seed": "abc"}, "noise_seed must be"),
    ],
    ids=lambda v: str(v)[:40] if isinstance(v, dict) else None,
)
def test_bad_arguments_name_the_argument(kwargs, match):
    """Before: ran 0 steps and reported ε, ignored, or an unnamed ValueError."""
    with pytest.raises(dpzoo.DPZooError, match=match):
        _private(_mlp(), _ds(), **kwargs)


def test_batch_size_larger_than_the_dataset_is_refused():
    with pytest.raises(dpzoo.DPZooError, match="batch_size 20 exceeds the dataset's 12 samples"):
        _private(_mlp(), _ds(), batch_size=20)


# -- the optimizer is an Optimizer -------------------------------------------------------------------
def test_dp_optimizer_is_a_torch_optimizer_and_schedulers_work():
    engine, model, opt, loader = _private(_mlp(), _ds(n=40), batch_size=10)
    assert isinstance(opt, torch.optim.Optimizer)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for x, y in loader:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * 0.5**4)
    assert opt.original_optimizer.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_step_hooks_run_on_noise_only_steps_too():
    engine, model, opt, loader = _private(_mlp(), _ds(n=40), batch_size=1)  # q = 1/40: mostly empty batches
    calls = []
    opt.attach_step_hook(lambda o: calls.append(o.steps))
    for x, y in loader:
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert len(calls) == engine.steps == 40


def test_bare_linear_root_model_is_exact():
    """A model that is one hooked layer (the root itself): before, its use was not recorded."""
    R, sigma, seed = 0.5, 0.6, 5
    torch.manual_seed(0)
    model, reference = nn.Linear(5, 3).double(), None
    reference = copy.deepcopy(model)
    engine, model, opt, loader = _private(
        model, _ds(n=6), batch_size=6, max_grad_norm=R, noise_multiplier=sigma, noise_seed=seed, loss_reduction="sum"
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = next(iter(loader))
    F.cross_entropy(model(x), y, reduction="sum").backward()
    opt.step()
    expected = _dp_update(reference, x, y, R, sigma, seed)
    for n, p in model.named_parameters():
        assert_close(p.detach() - before[n], expected[n], 1e-9, n)


class _WritesBatchIntoBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 3).double()

    def forward(self, x):
        with torch.no_grad():
            self.lin.bias.data += 1e-3 * x.mean()  # batch data written into a parameter
        return self.lin(x)


@pytest.mark.parametrize("earlier_spending", [False, True])
def test_parameters_are_checked_over_the_first_step_even_after_earlier_spending(earlier_spending):
    """Before: the check keyed on the accountant's step count, which includes a loaded model's
    earlier spending, so a model with privacy history skipped it."""
    model = _WritesBatchIntoBias()
    if earlier_spending:
        model.dpzoo_privacy = {"noise_multiplier": 2.0, "sample_rate": 0.1, "steps": 7, "epsilon": 1.0}
    # seeded sampling: with secret sampling all 12 samples stay out of an epoch's batches 0.8% of the time
    _, model, opt, loader = _private(model, _ds(), self_check=False, sample_seed=0)
    assert sum(len(x) for x, _ in loader) > 0
    with pytest.raises(PrivacyUsageError, match="lin.bias"):
        for x, y in loader:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()


def test_load_state_dict_with_another_mode_on_a_detached_engine_is_refused():
    """Before: it re-attached the norm hooks without the engine's per-step watch (buffers,
    parameters, self-check), so a buffer fed from batch data trained unrefused."""
    model = _mlp()
    engine = dpzoo.PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_ds(), batch_size=4),
        noise_multiplier=1.0,
    )
    state = copy.deepcopy(engine.state_dict())
    state["mode"] = "instantiate"
    engine.detach()
    with pytest.raises(PrivacyUsageError, match="detached"):
        engine.load_state_dict(state)


# -- averaging the released iterates (EMA / SWA): post-processing, and a copy without dpzoo's hooks ----


@pytest.mark.parametrize("kind", ["swa", "timm-ema"])
def test_ema_and_swa_of_a_private_model_work_and_leave_the_engine_alone(kind):
    """copy.deepcopy after make_private (AveragedModel, timm's ModelEmaV3) used to raise from deep in
    the optimizer; the copy is now a plain model: same function, and its forward/backward with grad
    enabled records nothing into the engine's step (training goes on, each step exact)."""
    from torch.optim.swa_utils import AveragedModel

    model, ds = _mlp(), _ds(n=12)
    engine, model, opt, loader = _private(model, ds, batch_size=4, sample_seed=0)
    if kind == "swa":
        average = AveragedModel(model)
    else:
        from timm.utils import ModelEmaV3

        average = ModelEmaV3(model, decay=0.5)
    iterates = []
    for x, y in loader:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        iterates.append([p.detach().clone() for p in model.parameters()])
        if kind == "swa":
            average.update_parameters(model)
        else:
            average.update(model)
        F.cross_entropy(average.module(x), y).backward()  # grad enabled on the copy
    assert engine.steps == len(iterates) >= 2
    x = torch.randn(3, 5, dtype=torch.float64)
    if kind == "swa":  # the plain mean of the iterates
        for k, p in enumerate(average.module.parameters()):
            assert torch.allclose(p, torch.stack([it[k] for it in iterates]).mean(0))
    bare = _mlp()  # the same function without any hook
    bare.load_state_dict(average.module.state_dict())
    assert torch.equal(average.module(x), bare(x))


# -- a δ that says nothing ---------------------------------------------------------------------------


def test_delta_of_at_least_one_over_n_is_refused_unless_accepted_and_then_recorded():
    """(ε, δ)-DP with δ ≥ 1/N is met by publishing one random sample in the clear: refused at
    make_private and at get_epsilon; accept_large_delta=True trains and the record says so."""
    ds = _ds(n=12)
    with pytest.raises(dpzoo.AccountingError, match=r"delta = 0\.1 is at least 1/N = 1/12.*accept_large_delta=True"):
        _private(_mlp(), ds, target_delta=0.1)
    engine, model, opt, loader = _private(_mlp(), ds, target_delta=1e-3)
    x, y = next(iter(loader))
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert engine.get_epsilon(1e-3) > 0 and "delta_note" not in engine.privacy_metadata()
    with pytest.raises(dpzoo.AccountingError, match="at least 1/N"):
        engine.get_epsilon(0.5)
    engine, model, opt, loader = _private(_mlp(), ds, target_delta=0.1, accept_large_delta=True)
    x, y = next(iter(loader))
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert "accepted by the user" in engine.privacy_metadata()["delta_note"]


def _train_once(model, engine=None, steps=2):
    engine = engine or dpzoo.PrivacyEngine()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = engine.make_private(
        module=model, optimizer=opt, data_loader=DataLoader(_ds(), batch_size=4), noise_multiplier=1.0, sample_seed=0
    )
    for i, (x, y) in enumerate(loader):
        if i == steps:
            break
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return engine


def test_spending_outlives_the_engine_and_is_shared_by_deep_copies():
    """A second engine on the same model composes the first's steps even once the first is detached
    and gone (it restarted ε before); a deep copy (EMA) is not refused by a new engine and carries
    the live spending of the model it copies."""
    import gc

    model = _mlp()
    first = _train_once(model)
    spent = [list(h) for h in first.accountant.history]
    twin = copy.deepcopy(model)  # e.g. an EMA of the released iterates
    first.detach()
    del first
    gc.collect()
    second = _train_once(model)
    assert second.accountant.history == [[1.0, spent[0][1], spent[0][2] + 2]]
    third = _train_once(twin)  # not refused as "already has dpzoo norm hooks"; composes the live spending
    assert third.accountant.history[0][2] == spent[0][2] + 2 + 2
