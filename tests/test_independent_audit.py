"""Independent privacy audit of dpzoo's engine (``dpzoo.PrivacyEngine``), through the public API.

Each test asserts the *correct* behaviour: either dpzoo refuses the use with a ``DPZooError``, or
what it computes is right (exact against a brute-force loop of single-sample backward passes in
float64, or, for the privacy claim itself, a released clipped sum whose add/remove sensitivity is
at most R). A test that fails shows dpzoo reporting a guarantee it does not have, or computing
something silently wrong, or (the "robustness" group) failing with an internal error instead of a
``DPZooError``. Tests that pass are uses dpzoo gets right, kept as regression checks.

The sensitivity probe (``_sensitivity``) is the DP claim made measurable: with σ = 0, q = 1 (every
sample in the one batch) and SGD at lr = 1, one engine step releases exactly the clipped sum
Σ_i C_i g_i (times 1/(q·N) with ``loss_reduction="mean"``, undone here). DP-SGD's ε assumes that
removing any one sample moves that sum by at most R. The probe removes each sample in turn and
measures how far the sum moves.
"""

from __future__ import annotations

import copy
import datetime
import os
import re
import socket
import warnings

import pytest
import torch
import torch.nn.functional as F
from dp_reference import dp_sgd_update, total_norms
from grad_reference import per_sample_grads
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset, TensorDataset

import dpzoo
from dpzoo.errors import (
    DPZooError,
    LossMixingError,
    PrivacyUsageError,
    ReproducibleNoiseWarning,
    SelfCheckError,
    UnsupportedModuleError,
)

F64 = torch.float64
DELTA = 1e-5

pytestmark = [
    pytest.mark.filterwarnings("ignore::dpzoo.errors.ReproducibleNoiseWarning"),
    pytest.mark.filterwarnings("ignore::dpzoo.errors.NoGradientWarning"),
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


# =============================================================================================
# helpers
# =============================================================================================


def _mlp(d=5, c=3, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, 8), nn.Tanh(), nn.Linear(8, c)).double()


def _ds(n=6, d=5, c=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, d, generator=g, dtype=F64), torch.randint(0, c, (n,), generator=g))


class _Items(Dataset):
    """A dataset given as a list of items (so one can be removed for the sensitivity probe)."""

    def __init__(self, items):
        self.items = list(items)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _private(model, data, batch_size=None, opt=None, lr=1.0, collate_fn=None, num_workers=0, **kw):
    engine = dpzoo.PrivacyEngine()
    opt = opt if opt is not None else torch.optim.SGD(model.parameters(), lr=lr)
    kw.setdefault("noise_multiplier", 1.0)
    loader_kw = {"collate_fn": collate_fn} if collate_fn is not None else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReproducibleNoiseWarning)
        model, opt, loader = engine.make_private(
            module=model,
            optimizer=opt,
            data_loader=DataLoader(data, batch_size=batch_size or len(data), num_workers=num_workers, **loader_kw),
            **kw,
        )
    return engine, model, opt, loader


def _dp_reference(model, loss_i, inputs, batch, R, sigma, seed, expected=None, lr=1.0):
    """DP-SGD's update by brute force: per-sample gradients from single-sample backward passes,
    Abadi clipping in closed form, noise drawn per trainable parameter in order from a generator
    seeded `seed` (tests/dp_reference.py)."""
    return dp_sgd_update(model, loss_i, inputs, batch, R, sigma, seed, "abadi", expected, lr)


def _assert_update(model, before, expected, rtol=1e-6):
    for n, p in model.named_parameters():
        if n in expected:
            d = p.detach() - before[n]
            err = (d - expected[n]).abs().max() / expected[n].abs().max().clamp_min(1e-12)
            assert err <= rtol, f"{n}: relative error {err:.2e}"


def _true_norms(model, loss_i, inputs, batch):
    grads = per_sample_grads(model, loss_i, inputs, batch)
    return torch.stack([torch.sqrt(sum(v.pow(2).sum() for v in g.values())) for g in grads])


def _released_sum(make_model, items, loss_fn, R, reduction="sum", collate_fn=None):
    """The clipped sum one engine step releases on all of `items` (σ = 0, q = 1, SGD lr = 1)."""
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    engine, model, opt, loader = _private(
        model,
        _Items(items),
        noise_multiplier=0.0,
        max_grad_norm=R,
        loss_reduction=reduction,
        sample_seed=0,
        collate_fn=collate_fn,
    )
    batch = next(iter(loader))
    loss_fn(model, batch).backward()
    opt.step()
    assert engine.steps == 1
    scale = engine.expected_batch_size if reduction == "mean" else 1.0
    return torch.cat([((b - p.detach()) * scale).flatten() for p, b in zip(model.parameters(), before)])


def _sensitivity(make_model, items, loss_fn, R, reduction="sum", collate_fn=None, refusal=None):
    """max over samples j of ‖S(D) − S(D \\ {j})‖, or None when dpzoo refuses the use with an
    error matching ``refusal`` (class, regex); any other error fails the test."""

    def released(subset):
        try:
            return _released_sum(make_model, subset, loss_fn, R, reduction, collate_fn)
        except DPZooError as e:
            if refusal is None or not isinstance(e, refusal[0]) or not re.search(refusal[1], str(e)):
                raise
            return None

    full = released(items)
    if full is None:
        return None
    worst = 0.0
    for j in range(len(items)):
        sub = released(items[:j] + items[j + 1 :])
        if sub is not None:
            worst = max(worst, (full - sub).norm().item())
    return worst


def _assert_sensitivity_at_most_R(make_model, items, loss_fn, R, **kw):
    s = _sensitivity(make_model, items, loss_fn, R, **kw)
    assert s is None or s <= R * (1 + 1e-9), (
        f"dpzoo released a clipped sum whose add/remove sensitivity is {s:.3f} = {s / R:.2f} R, yet accounts "
        f"it as R = {R} (false ε), and did not refuse"
    )
    return s


# =============================================================================================
# 1. Samples mixed outside the model: in the loss, in the training loop, in the collate
#    (the self-check sees the model only; each case below exceeds the sensitivity R)
# =============================================================================================


class _Tagger(nn.Module):
    def __init__(self, vocab=10, classes=10):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = nn.Embedding(vocab, 4), nn.Linear(4, classes)

    def forward(self, ids):
        return self.out(torch.tanh(self.emb(ids)))


class _Enc(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(5, 4)

    def forward(self, x):
        return self.lin(x)


class _MeanPool(nn.Module):
    """Mean over every position, padding included (the user forgot the attention mask)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = nn.Embedding(10, 4, padding_idx=0), nn.Linear(4, 3)

    def forward(self, ids):
        return self.out(torch.tanh(self.emb(ids)).mean(1))


def _xy_items(n=8, seed=3, scale=1.0, labels=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g, dtype=F64) * scale
    y = labels if labels is not None else torch.randint(0, 3, (n,), generator=g)
    return [(x[i], y[i]) for i in range(n)]


def test_mean_loss_of_independent_samples_has_sensitivity_R():
    """Control: the ordinary per-sample-separable loss (mean CE, loss_reduction="mean") is within R,
    and reaches R: the clip binds (per-sample norms above R), so this probe can fail."""
    items = _xy_items(8, labels=torch.tensor([0, 0, 2, 0, 2, 0, 0, 1]), scale=3.0)
    x, y = torch.stack([i[0] for i in items]), torch.stack([i[1] for i in items])
    grads = per_sample_grads(_mlp(), lambda m, x, y: F.cross_entropy(m(x), y, reduction="sum"), {"x": x, "y": y}, 8)
    R = 0.5
    assert total_norms(grads, list(grads[0])).max() > 2 * R
    s = _assert_sensitivity_at_most_R(_mlp, items, lambda m, b: F.cross_entropy(m(b[0]), b[1]), R, reduction="mean")
    assert s == pytest.approx(R, rel=1e-9)  # a clipped sample moves the sum by exactly R


@pytest.mark.parametrize("declared, used", [("mean", "sum"), ("sum", "mean")])
def test_reduction_mismatch_changes_the_scale_not_the_bound(declared, used):
    """loss_reduction says one thing, the loss does the other: dpzoo clips the wrongly scaled
    per-sample gradient (the update is not the intended DP-SGD), but each sample's released
    contribution is still at most R, so ε stays true."""
    R = 0.3
    model = _mlp()
    engine, model, opt, loader = _private(
        model, _ds(n=1), noise_multiplier=0.0, max_grad_norm=R, loss_reduction=declared
    )
    before = [p.detach().clone() for p in model.parameters()]
    x, y = next(iter(loader))
    F.cross_entropy(model(10 * x), y, reduction=used).backward()
    opt.step()
    released = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)]).norm().item()
    assert released <= R * (1 + 1e-9)


MIXING = (LossMixingError, "mixes samples")


def test_class_weighted_cross_entropy_mean_is_refused():
    """F.cross_entropy(out, y, weight=w) with the default mean divides by Σ_j w[y_j] over the batch:
    every sample's gradient is scaled by the others' labels (sensitivity ≈ 1.8 R before issue 33).
    Refused; the same weights with reduction="sum" are a per-sample loss and stay exact."""
    w = torch.tensor([1.0, 30.0, 1.0], dtype=F64)
    items = _xy_items(8, labels=torch.tensor([0, 0, 2, 0, 2, 0, 0, 1]), scale=0.3)
    weighted = lambda m, b: F.cross_entropy(m(b[0]), b[1], weight=w)
    assert _sensitivity(_mlp, items, weighted, 5.0, reduction="mean", refusal=MIXING) is None
    summed = lambda m, b: F.cross_entropy(m(b[0]), b[1], weight=w, reduction="sum")
    assert _assert_sensitivity_at_most_R(_mlp, items, summed, 0.5) > 0.5 * 0.99  # the clip binds


def test_token_mean_over_a_padded_batch_is_refused():
    """The usual LM loss, cross_entropy over flattened tokens with ignore_index and a mean: the
    divisor is the batch's token count (sensitivity ≈ 2.8 R before issue 33). Refused."""
    g = torch.Generator().manual_seed(3)
    n, T = 9, 12
    ids, lab = torch.full((n, T), 3), torch.full((n, T), -100)
    lab[:, 0] = 5  # eight one-token sequences
    ids[0] = torch.randint(1, 10, (T,), generator=g)  # and one long one
    lab[0] = torch.randint(0, 10, (T,), generator=g)
    items = [(ids[i], lab[i]) for i in range(n)]
    loss = lambda m, b: F.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten(), ignore_index=-100)
    assert _sensitivity(lambda: _Tagger().double(), items, loss, 1.0, reduction="mean", refusal=MIXING) is None


def test_in_batch_contrastive_loss_is_refused():
    """InfoNCE with in-batch negatives (logits z zᵀ / τ): each row's output gradient depends on every
    other sample (sensitivity ≈ 1.4 R before issue 33). Refused."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 5, generator=g, dtype=F64)
    items = [(x[i],) for i in range(8)]

    def infonce(m, b):
        z = F.normalize(m(b[0]), dim=1)
        return F.cross_entropy(z @ z.T / 0.1, torch.arange(len(z)), reduction="sum")

    assert _sensitivity(lambda: _Enc().double(), items, infonce, 1.0, refusal=MIXING) is None


def test_negatives_from_a_second_forward_on_shifted_rows_are_refused():
    """Two forward passes, one backward: anchors model(x) and negatives model(x.roll(1, 0)). Row
    counts match the batch, but row i of the second call is sample i-1: each sample reaches two
    clipped rows (sensitivity ≈ 1.8 R before issue 33). The loader's rows are tracked: refused."""
    items = [(t[0],) for t in _xy_items(8)]
    loss = lambda m, b: ((m(b[0]) - m(b[0].roll(1, 0))) ** 2).sum()
    assert _sensitivity(lambda: _Enc().double(), items, loss, 1.0, refusal=MIXING) is None


def test_mixup_in_the_training_loop_is_refused():
    """Mixup done in the loop, before the model: each input row holds two samples (sensitivity
    ≈ 1.3 R before issue 33). The loader's rows are tracked: refused."""
    lam = 0.6

    def mixup(m, b):
        x, y = b
        out = m(lam * x + (1 - lam) * x.roll(1, 0))
        return lam * F.cross_entropy(out, y, reduction="sum") + (1 - lam) * F.cross_entropy(
            out, y.roll(1, 0), reduction="sum"
        )

    assert _sensitivity(_mlp, _xy_items(6, seed=0), mixup, 1.0, refusal=MIXING) is None


def test_dynamic_padding_without_attention_mask_is_refused():
    """A collate that pads to the batch's longest sequence, and a model that attends to padding
    (no mask): each sample's output depends on the longest sequence in its batch (sensitivity
    ≈ 4 R before issue 33). The self-check collates samples of the first batch alone and runs
    them alone (dpzoo.privacy.padding_check): refused."""
    collate = lambda b: (pad_sequence([t for t, _ in b], batch_first=True), torch.stack([y for _, y in b]))
    items = [(torch.tensor([3]), torch.tensor(1)) for _ in range(6)] + [(torch.arange(1, 9), torch.tensor(2))]
    loss = lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="sum")
    refusal = (SelfCheckError, "collated alone, does not give its row")
    assert _sensitivity(lambda: _MeanPool().double(), items, loss, 1.0, collate_fn=collate, refusal=refusal) is None


class _MaskedMeanPool(_MeanPool):
    """The same model reading the padding mask: a mean over each sample's own tokens."""

    def forward(self, ids):
        mask = (ids != 0).unsqueeze(-1).to(self.out.weight.dtype)
        return self.out((torch.tanh(self.emb(ids)) * mask).sum(1) / mask.sum(1))


def test_dynamic_padding_with_a_mask_the_model_honours_has_sensitivity_R():
    collate = lambda b: (pad_sequence([t for t, _ in b], batch_first=True), torch.stack([y for _, y in b]))
    items = [(torch.tensor([3]), torch.tensor(1)) for _ in range(6)] + [(torch.arange(1, 9), torch.tensor(2))]
    loss = lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="sum")
    assert _assert_sensitivity_at_most_R(lambda: _MaskedMeanPool().double(), items, loss, 1.0, collate_fn=collate)


# =============================================================================================
# 2. State written from private data without noise (the buffer check watches registered
#    buffers' versions during a training-mode forward only)
# =============================================================================================


class _RunningMean(nn.Module):
    def __init__(self, how):
        super().__init__()
        torch.manual_seed(0)
        self.how = how
        self.a, self.b = nn.Linear(5, 8), nn.Linear(8, 3)
        if how == "frozen-parameter":
            self.running = nn.Parameter(torch.zeros(8), requires_grad=False)
        else:
            self.register_buffer("running", torch.zeros(8))

    def forward(self, x):
        h = torch.tanh(self.a(x))
        with torch.no_grad():
            if self.how == "data":  # old-style EMA update (VQ-VAE codebooks, many EMA helpers)
                self.running.data.mul_(0.9).add_(0.1 * h.mean(0))
            else:
                self.running.mul_(0.9).add_(0.1 * h.mean(0))
        return self.b(h)


def _state_after_one_step(model, data, eval_mode=False):
    """(refused, model) after one engine step (None if dpzoo refused)."""
    if eval_mode:
        model.eval()
    try:
        engine, model, opt, loader = _private(model, data, noise_multiplier=1.0, noise_seed=0, sample_seed=0)
        x, y = next(iter(loader))
        F.cross_entropy(model(x), y).backward()
        opt.step()
    except DPZooError:
        return True, model
    return False, model


@pytest.mark.parametrize(
    "how, eval_mode",
    [("data", False), ("frozen-parameter", False), ("inplace", True)],
    ids=["buffer-via-.data", "frozen-nn.Parameter", "buffer-root-in-eval-mode"],
)
def test_running_statistic_written_from_the_batch(how, eval_mode):
    """A running mean of the batch's activations, kept (a) in a buffer updated through `.data` (its
    version counter does not move), (b) in a frozen nn.Parameter (not a buffer), (c) in a buffer of
    a model trained in eval mode (to switch dropout off): the statistic is saved with the model,
    noise-free. Today: accepted; only the plain in-place buffer update in train mode is refused."""
    refused, model = _state_after_one_step(_RunningMean(how).double(), _ds(), eval_mode)
    assert refused or torch.count_nonzero(model.running) == 0, "batch statistics released without noise"


def test_frozen_embedding_with_max_norm_renormalises_the_rows_it_looks_up():
    """nn.Embedding(max_norm=...) renormalises, in place during forward, exactly the rows the batch
    looks up. Frozen (e.g. pretrained vectors), it needs no rule, so nothing checks it: the saved
    model shows which tokens were in the private batches. Today: accepted, rows changed = ids seen."""

    class EmbMax(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.Embedding(20, 4, max_norm=1.0)
            self.emb.weight.requires_grad_(False)
            with torch.no_grad():
                self.emb.weight.mul_(3)
            self.out = nn.Linear(4, 3)

        def forward(self, ids):
            return self.out(self.emb(ids).mean(1))

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randint(0, 10, (6, 3), generator=g), torch.randint(0, 3, (6,), generator=g))
    model = EmbMax().double()
    w0 = model.emb.weight.detach().clone()
    refused, model = _state_after_one_step(model, data)
    assert refused or torch.equal(model.emb.weight, w0), "frozen embedding rows changed by the private batch"


def test_data_dependent_initialisation_of_a_trainable_bias():
    """ActNorm / LSUV-style data-dependent init in the first training forward: a's bias is set from
    the first batch's mean through `.data`. With R = 1e-12 and σ = 0 the DP update is ~0, yet the
    bias moves by ~0.7. Today: accepted."""

    class DataInit(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(5, 8), nn.Linear(8, 3)
            self.initialised = False

        def forward(self, x):
            if self.training and not self.initialised:
                with torch.no_grad():
                    self.a.bias.data -= self.a(x).mean(0)
                self.initialised = True
            return self.b(torch.tanh(self.a(x)))

    model = DataInit().double()
    b0 = model.a.bias.detach().clone()
    try:
        engine, model, opt, loader = _private(model, _ds(), noise_multiplier=0.0, max_grad_norm=1e-12, sample_seed=0)
        x, y = next(iter(loader))
        F.cross_entropy(model(x), y).backward()
        opt.step()
    except DPZooError:
        return
    assert (model.a.bias.detach() - b0).norm() <= 1e-9, "first batch's statistics written into a parameter"


def test_backward_hook_accumulating_gradient_statistics_into_a_buffer():
    """A user's full backward hook keeps a buffer of output-gradient magnitudes (gradient monitoring).
    It runs inside dpzoo's ghost differentiation on unclipped per-sample data and is saved with the
    model. Today: accepted, buffer non-zero."""

    class GradStat(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(5, 8), nn.Linear(8, 3)
            self.register_buffer("gstat", torch.zeros(8))
            self.a.register_full_backward_hook(self._hook)

        def _hook(self, module, grad_in, grad_out):
            self.gstat.add_(grad_out[0].abs().sum(0))

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    refused, model = _state_after_one_step(GradStat().double(), _ds())
    assert refused or torch.count_nonzero(model.gstat) == 0, "gradient statistics released without noise"


def test_batchnorm_without_running_stats_made_private_in_eval_then_trained_is_refused():
    """Control: BatchNorm2d(track_running_stats=False) passes make_private's mode-based check when
    the model is in eval mode; switched to train mode it mixes samples and dpzoo refuses it."""
    torch.manual_seed(0)
    model = (
        nn.Sequential(
            nn.Conv2d(2, 4, 3),
            nn.BatchNorm2d(4, affine=False, track_running_stats=False),
            nn.Flatten(),
            nn.Linear(16, 3),
        )
        .double()
        .eval()
    )
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(6, 2, 4, 4, generator=g, dtype=F64), torch.randint(0, 3, (6,), generator=g))
    with pytest.raises(UnsupportedModuleError, match=r"BatchNorm module\(s\) 1 use batch statistics"):
        engine, model, opt, loader = _private(model, data)
        model.train()
        x, y = next(iter(loader))
        F.cross_entropy(model(x), y).backward()
        opt.step()


# =============================================================================================
# 3. Parameters outside the model
# =============================================================================================


def test_head_outside_the_model_with_its_own_optimizer_is_refused():
    """The realistic bug the audit's 'unclipped' control models: a head outside the private model,
    trained by its own plain optimizer on the loss of the private batch (before issue 33:
    accepted, the head trained on raw gradients). Refused where the head meets the outputs."""
    body, head = _mlp(c=4), nn.Linear(4, 3).double()
    engine, body, opt, loader = _private(body, _ds(), sample_seed=0)
    x, y = next(iter(loader))
    with pytest.raises(UnsupportedModuleError, match="outside the private model meets its outputs"):
        F.cross_entropy(head(body(x)), y)


def test_trainable_module_before_the_model_is_refused():
    """A trainable module in front of the private model: its output requires grad, and no
    gradient would reach it through ghost differentiation (nor be clipped). Refused at the call."""
    stem, body = nn.Linear(5, 5).double(), _mlp()
    engine, body, opt, loader = _private(body, _ds(), sample_seed=0)
    x, y = next(iter(loader))
    with pytest.raises(PrivacyUsageError, match="input of the private model requires grad"):
        body(stem(x))


def test_weight_tied_after_make_private_is_refused():
    """Control: tying b.weight to a.weight after make_private is refused (conservative)."""

    class Sq(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b, self.c = nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 3)

        def forward(self, x):
            return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))

    model = Sq().double()
    engine, model, opt, loader = _private(model, _ds(), sample_seed=0)
    model.b.weight = model.a.weight
    with pytest.raises(PrivacyUsageError, match=r"Parameter\(s\) b\.weight are not in the model during this forward"):
        x, y = next(iter(loader))
        F.cross_entropy(model(x), y).backward()
        opt.step()


# =============================================================================================
# 4. The first-step self-check
# =============================================================================================


class _Permuting(nn.Module):
    """Rows rolled between the two layers (and back): the hooks pair the wrong rows."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(5, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)).roll(1, 0)).roll(-1, 0)


def _loop_catching(engine, model, opt, loader):
    outcomes = []
    for x, y in loader:
        try:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            outcomes.append("stepped")
        except DPZooError as e:
            outcomes.append(type(e).__name__)
        opt.zero_grad()
    return outcomes


def test_a_failed_self_check_keeps_refusing():
    """The self-check refuses the first step; a loop that catches DPZooError and moves on (to skip
    'bad batches') then trains, unchecked, the model the check rejected: the check is disarmed
    before it runs and never re-armed. Today: ['SelfCheckError', 'stepped', 'stepped', 'stepped']."""
    engine, model, opt, loader = _private(_Permuting().double(), _ds(n=40), batch_size=10, target_delta=DELTA)
    outcomes = _loop_catching(engine, model, opt, loader)
    assert outcomes[0] == "SelfCheckError"
    assert "stepped" not in outcomes, f"steps taken after the self-check failed: {outcomes}"


def test_metadata_after_a_failed_self_check_is_not_pending():
    """After the failure above and steps taken anyway, the privacy metadata says the self-check is
    'pending (no non-empty step yet)'. It must not claim pending (or passed) once steps were taken."""
    engine, model, opt, loader = _private(_Permuting().double(), _ds(n=40), batch_size=10, target_delta=DELTA)
    _loop_catching(engine, model, opt, loader)
    check = engine.privacy_metadata()["self_check"]
    assert engine.steps == 0 or not check.startswith(("pending", "passed")), (
        f"{engine.steps} steps taken, metadata says self_check={check!r}"
    )


class _SortRestore(nn.Module):
    """Processes the batch sorted by its first feature (length bucketing), then restores the order."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(5, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        order = torch.argsort(x[:, 0])
        return self.b(h[order])[torch.argsort(order)]


def test_self_check_misses_a_permutation_that_fixes_the_rows_it_checks():
    """The self-check compares rows 0, B//2 and B-1 (and the unweighted sum of per-sample gradients,
    which any permutation preserves). A data-dependent sort that leaves those rows in place (here it
    swaps rows 1 and 3 of 5) passes, and rows 1 and 3 get wrong per-sample norms: b's gradient of
    sample 3 is clipped with sample 1's factor. Today: accepted, norms of rows 1 and 3 off by ~2.5%."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 5, generator=g, dtype=F64)
    x[:, 0] = torch.tensor([0.0, 3.0, 2.0, 1.0, 4.0], dtype=F64)
    y = torch.randint(0, 3, (5,), generator=g)
    loss_i = lambda m, x, y: F.cross_entropy(m(x), y, reduction="sum")
    true = _true_norms(_SortRestore().double(), loss_i, {"x": x, "y": y}, 5)
    try:
        engine, model, opt, loader = _private(
            _SortRestore().double(), TensorDataset(x, y), loss_reduction="sum", max_grad_norm=100.0, sample_seed=0
        )
        xb, yb = next(iter(loader))
        F.cross_entropy(model(xb), yb, reduction="sum").backward()
        opt.step()
    except DPZooError:
        return
    got = engine.optimizer.last_per_sample_norms
    assert torch.allclose(got, true, rtol=1e-6, atol=0), f"per-sample norms {got.tolist()} vs true {true.tolist()}"


# =============================================================================================
# 5. The privacy unit: what counts as one sample, and records the mechanism cannot bound
# =============================================================================================


class _TokDS(Dataset):
    def __init__(self, n=6, T=4):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, 10, (n, T), generator=g)
        self.lab = torch.randint(0, 5, (n, T), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return self.ids[i], self.lab[i]


def test_time_major_collate_is_not_counted_as_the_batch():
    """A collate with pad_sequence's default layout (T, B). The loader measures the logical batch
    from the collated tensor's dim 0 (T = 4), not from the 6 samples it drew, so the rows check
    agrees with the 4 time-step rows the engine clips (each holding all 6 samples); a per-token
    model passes the self-check. Today: accepted, 4 rows clipped for 6 samples."""
    collate = lambda s: (pad_sequence([a for a, _ in s]), pad_sequence([b for _, b in s], padding_value=-100))
    data = _TokDS()
    try:
        engine, model, opt, loader = _private(
            _Tagger(classes=5).double(), data, collate_fn=collate, loss_reduction="sum", sample_seed=0
        )
        ids, lab = next(iter(loader))
        F.cross_entropy(model(ids).flatten(0, 1), lab.flatten(), ignore_index=-100, reduction="sum").backward()
        opt.step()
    except DPZooError:
        return
    rows = engine.optimizer.last_per_sample_norms.shape[0]
    assert rows == len(data), f"{rows} rows clipped for the {len(data)} samples drawn (q = 1)"


def test_a_record_with_a_missing_value_does_not_release_nan():
    """One record with a NaN feature (a missing value): its per-sample norm is NaN, its clip factor
    NaN, and the released update is NaN for every parameter, so the record's presence is visible
    with certainty (no noise hides a NaN). Refusing, or dropping the non-finite row, would keep ε
    true. Today: step taken and accounted, every parameter NaN."""
    x, y = _ds().tensors
    x = x.clone()
    x[2, 0] = float("nan")
    try:
        engine, model, opt, loader = _private(_mlp(), TensorDataset(x, y), sample_seed=0)
        xb, yb = next(iter(loader))
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
    except DPZooError:
        return
    assert all(torch.isfinite(p).all() for p in model.parameters()), "a NaN update was released"


# =============================================================================================
# 6. torch.distributed: settings that differ between ranks
# =============================================================================================


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dist_worker(rank, world, port, out_dir):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    try:
        x, y = _ds(n=8).tensors
        # (R per rank, batch size per rank): a clipping bound, or a per-rank share of an uneven global batch
        for case, (Rs, bss) in {"max_grad_norm": ((1.0, 50.0), (4, 4)), "batch_size": ((1.0, 1.0), (2, 4))}.items():
            model = _mlp()
            try:
                engine, model, opt, loader = _private(
                    model,
                    TensorDataset(x, y),
                    batch_size=bss[rank],
                    max_grad_norm=Rs[rank],
                    loss_reduction="sum",
                    sample_seed=0,
                )
                for xb, yb in loader:
                    F.cross_entropy(model(xb), yb, reduction="sum").backward()
                    opt.step()
                    break
                results[case] = {
                    "refused": False,
                    "R": engine.max_grad_norm,
                    "q": engine.sample_rate,
                    "eps": engine.get_epsilon(DELTA),
                }
            except DPZooError as e:
                results[case] = {"refused": True, "error": str(e)}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        # both ranks done before either tears gloo down (a rank leaving mid-teardown aborted the
        # other with "terminate called without an active exception"); bounded, so a failed rank cannot hang it
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=120))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def distributed_runs(tmp_path_factory):
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out = tmp_path_factory.mktemp("dist")
    mp.spawn(_dist_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("case", ["max_grad_norm", "batch_size"])
def test_ranks_must_agree_on_the_mechanism(distributed_runs, case):
    """Rank 0 draws the noise with its own σ·R; each rank clips with its own R and samples its shard
    at its own q. Rank 1 clipping at R = 50 under noise for R = 1, or sampling its shard at q = 1
    while rank 0 reports ε for q = 0.5, makes the reported ε false for rank 1's samples. Today:
    accepted; both ranks report ε 4.73 with R 1 vs 50, and ε 3.89 vs 4.73 for the batch sizes."""
    r0, r1 = (r[case] for r in distributed_runs)
    if r0["refused"] and r1["refused"]:
        return
    assert not (r0["refused"] or r1["refused"]), "one rank refused, the other trained"
    assert r0["R"] == r1["R"] and r0["q"] == r1["q"], f"ranks trained with different settings: {r0} vs {r1}"


# =============================================================================================
# 7. Accounting and metadata across resumes
# =============================================================================================


def _indaudit_mlp(**_):
    """A small MLP for the independent audit (dpzoo.save needs a zoo entry)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()


@pytest.fixture(scope="module")
def zoo_entry():
    """Registers 'indaudit-mlp' for these tests only (other tests iterate dpzoo.list_models())."""
    dpzoo.register_model("indaudit-mlp")(_indaudit_mlp)
    yield "indaudit-mlp"
    dpzoo.unregister_model("indaudit-mlp")


def _zoo():
    return dpzoo.load("indaudit-mlp")


def _train(engine, model, opt, loader, steps):
    while engine.steps < steps:
        for x, y in loader:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if engine.steps >= steps:
                break


def _first_run(steps=6):
    engine, model, opt, loader = _private(_zoo(), _ds(n=12), batch_size=4, target_delta=DELTA)
    _train(engine, model, opt, loader, steps)
    return engine, model, opt, loader


def test_resume_from_model_and_optimizer_state_dicts_keeps_counting(zoo_entry):
    """The ordinary PyTorch resume (model.state_dict() and optimizer.state_dict(), not the engine's):
    the DPOptimizer's state says 6 steps were taken, yet ε restarts from 0. Today: ε 3.41 after the
    resumed step instead of ≥ 6.84 (the optimizer itself counts 7 steps)."""
    engine, model, opt, _ = _first_run()
    eps_before = engine.get_epsilon(DELTA)
    ckpt = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict())}
    model2 = _zoo()
    model2.load_state_dict(ckpt["model"])
    engine2, model2, opt2, loader2 = _private(model2, _ds(n=12), batch_size=4, target_delta=DELTA)
    try:
        opt2.load_state_dict(ckpt["opt"])
        _train(engine2, model2, opt2, loader2, 1)
    except DPZooError:
        return
    assert engine2.get_epsilon(DELTA) >= eps_before, (
        f"ε {engine2.get_epsilon(DELTA):.3g} reported after resuming a run that had spent {eps_before:.3g}"
    )


def test_second_engine_on_the_same_model_keeps_the_first_spending(zoo_entry, tmp_path):
    """Phase 2 with new settings needs a new engine (make_private refuses reuse); the model is then
    saved. dpzoo.save writes the last engine's ε only. Today: 3.41 saved after 6.84 was spent."""
    engine, model, opt, loader = _first_run()
    eps_first = engine.get_epsilon(DELTA)
    engine.detach()
    try:
        engine2, model, opt2, loader2 = _private(model, _ds(n=12), batch_size=4, target_delta=DELTA)
        _train(engine2, model, opt2, loader2, 1)
        dpzoo.save(model, tmp_path / "m")
    except DPZooError:
        return
    saved = dpzoo.privacy_metadata(tmp_path / "m")["epsilon"]
    assert saved >= eps_first, f"saved ε {saved:.3g} after {eps_first:.3g} had been spent on this model"


def test_continuing_a_loaded_dp_model_keeps_its_spending(zoo_entry, tmp_path):
    """dpzoo.load restores the saved privacy metadata (model.dpzoo_privacy); training it further with
    a new engine and saving replaces that ε by the new engine's alone. Today: 3.41 saved, 6.84 loaded."""
    engine, model, opt, loader = _first_run()
    dpzoo.save(model, tmp_path / "a")
    loaded = dpzoo.load(tmp_path / "a").train()
    eps_loaded = loaded.dpzoo_privacy["epsilon"]
    try:
        engine2, loaded, opt2, loader2 = _private(loaded, _ds(n=12), batch_size=4, target_delta=DELTA)
        _train(engine2, loaded, opt2, loader2, 1)
        dpzoo.save(loaded, tmp_path / "b")
    except DPZooError:
        return
    saved = dpzoo.privacy_metadata(tmp_path / "b")["epsilon"]
    assert saved >= eps_loaded, f"saved ε {saved:.3g} for a model that was loaded with ε {eps_loaded:.3g}"


# =============================================================================================
# 8. Uses dpzoo gets right (exact against brute force in float64)
# =============================================================================================

R, SIGMA, SEED = 0.5, 0.7, 3


def test_uneven_micro_batches_with_a_mean_loss_are_exact():
    """max_physical_batch_size=3 on a batch of 7 (micro-batches 3, 3, 1), each with its own mean."""
    model, ref = _mlp(), _mlp()
    engine, model, opt, loader = _private(
        model,
        _ds(n=7),
        max_grad_norm=R,
        noise_multiplier=SIGMA,
        noise_seed=SEED,
        sample_seed=0,
        max_physical_batch_size=3,
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    xs, ys = [], []
    for x, y in loader:
        xs.append(x)
        ys.append(y)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if engine.steps == 1:
            break
    assert [len(x) for x in xs] == [3, 3, 1]
    x, y = torch.cat(xs), torch.cat(ys)
    expected = _dp_reference(
        ref,
        lambda m, x, y: F.cross_entropy(m(x), y, reduction="sum"),
        {"x": x, "y": y},
        len(x),
        R,
        SIGMA,
        SEED,
        expected=7.0,
    )
    _assert_update(model, before, expected)


def test_two_views_of_each_sample_in_two_forwards_are_exact():
    """model(x) and model(aug(x)) (the same samples, row for row), one loss, one backward."""
    model, ref = _mlp(), _mlp()
    engine, model, opt, loader = _private(
        model, _ds(), max_grad_norm=R, noise_multiplier=SIGMA, noise_seed=SEED, sample_seed=0, loss_reduction="sum"
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = next(iter(loader))
    aug = lambda t: t.flip(1)
    (F.cross_entropy(model(x), y, reduction="sum") + F.cross_entropy(model(aug(x)), y, reduction="sum")).backward()
    opt.step()
    loss_i = lambda m, x, y: F.cross_entropy(m(x), y, reduction="sum") + F.cross_entropy(m(aug(x)), y, reduction="sum")
    _assert_update(model, before, _dp_reference(ref, loss_i, {"x": x, "y": y}, len(x), R, SIGMA, SEED))


def test_step_with_a_closure_is_exact():
    model, ref = _mlp(), _mlp()
    engine, model, opt, loader = _private(
        model, _ds(), max_grad_norm=R, noise_multiplier=SIGMA, noise_seed=SEED, sample_seed=0, loss_reduction="sum"
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = next(iter(loader))

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y, reduction="sum")
        loss.backward()
        return loss

    opt.step(closure)
    loss_i = lambda m, x, y: F.cross_entropy(m(x), y, reduction="sum")
    _assert_update(model, before, _dp_reference(ref, loss_i, {"x": x, "y": y}, len(x), R, SIGMA, SEED))
    assert engine.steps == 1


class _DictDS(Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 10, (6, 4), generator=g)
        self.mask = torch.ones(6, 4, dtype=torch.long)
        self.mask[:, 3] = 0
        self.y = torch.randint(0, 3, (6,), generator=g)

    def __len__(self):
        return 6

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.y[i]}


class _TokCls(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = nn.Embedding(10, 4), nn.Linear(4, 3)

    def forward(self, input_ids, attention_mask):
        h = torch.tanh(self.emb(input_ids)) * attention_mask.unsqueeze(-1)
        return self.out(h.sum(1) / attention_mask.sum(1, keepdim=True))


def test_hf_style_dict_batches_with_workers_and_micro_batches_are_exact():
    """Dict batches (input_ids, attention_mask, labels), model(**batch), num_workers=2,
    max_physical_batch_size=4 (micro-batches 4 and 2)."""
    model, ref = _TokCls().double(), _TokCls().double()
    engine, model, opt, loader = _private(
        model,
        _DictDS(),
        max_grad_norm=R,
        noise_multiplier=SIGMA,
        noise_seed=SEED,
        sample_seed=0,
        loss_reduction="sum",
        max_physical_batch_size=4,
        num_workers=2,
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batches = []
    for b in loader:
        batches.append(b)
        labels = b.pop("labels")
        F.cross_entropy(model(**b), labels, reduction="sum").backward()
        opt.step()
        opt.zero_grad()
        if engine.steps == 1:
            break
    assert [b["input_ids"].shape[0] for b in batches] == [4, 2]
    ids = torch.cat([b["input_ids"] for b in batches])
    mask = torch.cat([b["attention_mask"] for b in batches])
    loss_i = lambda m, ids, mask, y: F.cross_entropy(m(ids, mask), y, reduction="sum")
    expected = _dp_reference(ref, loss_i, {"ids": ids, "mask": mask, "y": _DictDS().y}, 6, R, SIGMA, SEED)
    _assert_update(model, before, expected)


def test_model_converted_to_double_after_make_private_is_exact():
    model, ref = _mlp().float(), _mlp()
    engine, model, opt, loader = _private(
        model, _ds(), max_grad_norm=R, noise_multiplier=SIGMA, noise_seed=SEED, sample_seed=0, loss_reduction="sum"
    )
    model.double()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = next(iter(loader))
    F.cross_entropy(model(x), y, reduction="sum").backward()
    opt.step()
    loss_i = lambda m, x, y: F.cross_entropy(m(x), y, reduction="sum")
    _assert_update(model, before, _dp_reference(ref, loss_i, {"x": x, "y": y}, len(x), R, SIGMA, SEED))


def test_users_clip_grad_norm_before_step_does_not_change_the_update():
    """clip_grad_norm_ on .grad before step(): ghost differentiation leaves .grad None, so it is a
    no-op and the update is exactly DP-SGD's."""
    model, ref = _mlp(), _mlp()
    engine, model, opt, loader = _private(
        model, _ds(), max_grad_norm=R, noise_multiplier=SIGMA, noise_seed=SEED, sample_seed=0, loss_reduction="sum"
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = next(iter(loader))
    F.cross_entropy(model(x), y, reduction="sum").backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    opt.step()
    loss_i = lambda m, x, y: F.cross_entropy(m(x), y, reduction="sum")
    _assert_update(model, before, _dp_reference(ref, loss_i, {"x": x, "y": y}, len(x), R, SIGMA, SEED))


def test_poisson_membership_does_not_follow_torch_manual_seed():
    def first_batch():
        torch.manual_seed(1234)
        engine, model, opt, loader = _private(_mlp(), _ds(n=200), batch_size=20)
        return next(iter(loader.batch_sampler))

    assert first_batch() != first_batch()
    assert first_batch() != first_batch()


# =============================================================================================
# 9. Robustness: internal errors where dpzoo promises a DPZooError or a correct result
#    (loud, not silent: no privacy loss, but not the documented contract)
# =============================================================================================


def test_functional_call_from_outside_the_model():
    """torch.func.functional_call(model, {k: 2·θ}) in the training loop: the engine's forward
    pre-hook takes the swapped-in tensors for newly trainable parameters and re-plans the hooks on
    them. Today: KeyError inside NormHooks._collect at step()."""
    model = _mlp()
    engine, model, opt, loader = _private(model, _ds(), sample_seed=0)
    x, y = next(iter(loader))
    try:
        out = torch.func.functional_call(model, {k: 2 * v for k, v in model.named_parameters()}, (x,))
        F.cross_entropy(out, y).backward()
        opt.step()
    except DPZooError:
        return
    pytest.fail("functional_call with transformed parameters was neither refused nor checked")


def test_switch_mode_between_forward_and_backward():
    """switch_mode after the forward, before the backward. Today: RuntimeError ('No hooked layer
    took part in this forward pass') from the old hooks."""
    engine, model, opt, loader = _private(_mlp(), _ds(n=20), batch_size=5, sample_seed=0)
    x, y = next(iter(loader))
    out = model(x)
    with pytest.raises(PrivacyUsageError, match="switch_mode in the middle of a logical step"):
        engine.switch_mode("instantiate")
        F.cross_entropy(out, y).backward()
        opt.step()


def test_evaluation_forward_with_grad_enabled_does_not_poison_the_next_steps():
    """Validation in the loop with model.eval() but without torch.no_grad(): the forward tags the
    already stepped batch, and every later step is refused ('clipped samples of an earlier logical
    batch'). A forward whose output is never back-propagated should not change the next step."""
    data = _ds(n=20)
    engine, model, opt, loader = _private(_mlp(), data, batch_size=5, sample_seed=0)
    outcomes = []
    for x, y in loader:
        try:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            outcomes.append("ok")
        except DPZooError as e:
            outcomes.append(str(e)[:60])
        opt.zero_grad()
        model.eval()
        model(data.tensors[0][:3])  # validation, grad enabled by mistake
        model.train()
    assert outcomes == ["ok"] * len(outcomes), outcomes


def test_dict_batch_with_a_string_field_first():
    """A Hugging Face-style dataset whose first column is the raw text. Today: TypeError('cannot
    tell the batch size of str') from the loader."""
    x, y = _ds().tensors

    class TextDS(Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return {"text": f"sample {i}", "x": x[i], "y": y[i]}

    engine, model, opt, loader = _private(_mlp(), TextDS(), batch_size=3, sample_seed=0)
    try:
        for b in loader:
            F.cross_entropy(model(b["x"]), b["y"]).backward()
            opt.step()
    except DPZooError:
        return
    assert engine.steps == 2


def test_float_max_physical_batch_size_is_refused_or_works():
    """max_physical_batch_size=2.0 passes make_private's integer check, then range() fails when
    the loader splits a batch. Today: TypeError."""
    try:
        engine, model, opt, loader = _private(_mlp(), _ds(), noise_multiplier=1.0, max_physical_batch_size=2.0)
        for x, y in loader:
            F.cross_entropy(model(x), y).backward()
            opt.step()
    except DPZooError:
        return
    assert engine.steps == 1


def test_lazy_modules_are_refused_with_a_dpzoo_error_or_work():
    """nn.LazyLinear before its first forward. Today: torch's ValueError (uninitialized parameter)
    from inside make_private."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(8), nn.Tanh(), nn.Linear(8, 3)).double()
    try:
        engine, model, opt, loader = _private(model, _ds(), noise_multiplier=1.0)
        x, y = next(iter(loader))
        F.cross_entropy(model(x), y).backward()
        opt.step()
    except DPZooError:
        return
    assert engine.steps == 1


def test_cpu_bfloat16_autocast_is_refused_or_works():
    """torch.autocast('cpu', bfloat16) around the forward. Today: RuntimeError ('expected scalar
    type BFloat16 but found Float') from a rule at step()."""
    x, y = _ds().tensors
    engine, model, opt, loader = _private(_mlp().float(), TensorDataset(x.float(), y), sample_seed=0)
    xb, yb = next(iter(loader))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
    except DPZooError:
        return
    assert engine.steps == 1 and all(torch.isfinite(p).all() for p in model.parameters())
