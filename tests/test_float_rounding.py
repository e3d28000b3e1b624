"""The clip uses an upper bound on the exact per-sample norm, float32 rounding included
(grad_norms/rounding.py, grad_norms/float_guard.py).

Found by the second independent audit: above the float64 recheck line, float32 rounding of the Gram
entries of wide layers let a crafted sample that cancels go out above R (1.01 R at 16,384 features
and 1.04 R at 65,536 before the bound, measured with the test below). The guarded norm now
adds a rigorous bound on that rounding, so it is never below the exact norm.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from dp_reference import seeded_noise
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpzoo
from dpzoo.grad_norms import float_guard
from dpzoo.grad_norms import reps as R
from dpzoo.grad_norms.param_grad import ParamGrad


class _UsedTwice(nn.Module):
    """One weight, two uses: x1 (one position: ghost norm) and x2 (128 positions: instantiated)."""

    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, 1, bias=False)

    def forward(self, x1, x2):
        return self.lin(x1), self.lin(x2)


def _noise_free(model, dataset, r: float):
    """make_private with σ = 0 and a fixed sample seed (both warned about, both wanted here): the
    released gradient is the clipped sum itself."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dpzoo.PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
            data_loader=DataLoader(dataset, batch_size=4),
            noise_multiplier=0.0,
            max_grad_norm=r,
            loss_reduction="sum",
            mode="bk-mixopt",
            sample_seed=1,
            self_check=False,
        )


def released_contribution(d: int, eps: float) -> float:
    """Sample 0 alone has a gradient: its first use gives δ·xᵀ, its second −(1−ε)·δ·xᵀ, with x all
    ones (float32 sums of equal terms round the most), so ‖g‖ = ε‖δ‖‖x‖ just above the recheck line
    (2⁻⁶·U). Returns the released gradient's norm (no noise) in units of R."""
    torch.manual_seed(0)
    model, opt, loader = _noise_free(_UsedTwice(d), TensorDataset(torch.zeros(16, 1, d), torch.zeros(16, 128, d)), 1.0)
    x1, x2 = next(b for b in loader if len(b[0]))
    x1, x2 = torch.zeros_like(x1), torch.zeros_like(x2)
    x = torch.ones(d) / d**0.5 * 1000
    x1[0, 0] = x2[0, 0] = x
    a, b = model(x1, x2)
    delta = 1000.0
    (delta * a[0, 0].sum() - (1 - eps) * delta * b[0, 0].sum()).backward()
    opt.step()
    return next(p for p in model.parameters()).grad.double().norm().item()


@pytest.mark.parametrize("d, eps", [(16384, 0.0319), (65536, 0.0359)])
def test_a_crafted_wide_cancelling_sample_is_clipped_to_r(d, eps):
    # 1.012 R and 1.044 R before the bound; what remains above 1 is the clipped sum's own float32
    # rounding (~1e-6 R here), not the norm's
    assert released_contribution(d, eps) <= 1 + 1e-5


def _exact_sq_norms(reps: list) -> torch.Tensor:
    """‖Σ_u g_u‖² per sample in float64, from the instantiated gradients."""
    total = None
    for r in reps:
        if isinstance(r, R.Dense):
            g = r.grad.double()
        elif isinstance(r, R.Factored):
            g = R.instantiate(R.Factored(r.left.double(), r.right.double(), r.shape))
        else:
            g = R.instantiate(R.OneHot(r.index, r.right.double(), r.num_rows))
        total = g if total is None else total + g
    return total.flatten(1).square().sum(1)


def _cancelling_uses(gen, b: int, t: int, r: int, c: int, eps: float, kind: str) -> list:
    """Two uses of one (c, r) weight whose gradients cancel up to ε, in random directions."""
    left = torch.randn(b, 1, t, r, generator=gen).abs() + 1  # same-sign entries: float32 rounds the most
    right = torch.randn(b, 1, t, c, generator=gen)
    first = R.Factored(left, right, (r, c))
    if kind == "dense":
        second = R.Dense(-(1 - eps) * R.instantiate(first))
    else:
        second = R.Factored(left.clone(), -(1 - eps) * right, (r, c))
    return [first, second]


@pytest.mark.parametrize("kind", ["dense", "factored"])
@pytest.mark.parametrize("eps", [0.02, 0.04, 0.1, 0.5])
@pytest.mark.parametrize("r, t", [(4096, 1), (512, 6)])
def test_the_guarded_norm_is_never_below_the_exact_one(kind, eps, r, t):
    gen = torch.Generator().manual_seed(int(eps * 1000) + r + t)
    reps = _cancelling_uses(gen, 6, t, r, 3, eps, kind)
    guarded = ParamGrad(reps, ghost=None, choices=[True, True]).sq_norm()
    assert (guarded.double() >= _exact_sq_norms(reps)).all()


@pytest.mark.parametrize("seed", range(6))
def test_random_shapes_and_representations_are_bounded_and_tight(seed):
    gen = torch.Generator().manual_seed(seed)
    b, t, g = 5, int(torch.randint(1, 12, (1,), generator=gen)), int(torch.randint(1, 3, (1,), generator=gen))
    r, c, v = (int(x) for x in torch.randint(2, 40, (3,), generator=gen))
    shape = (g, r, c)
    reps = [
        R.Factored(torch.randn(b, g, t, r, generator=gen), torch.randn(b, g, t, c, generator=gen), shape),
        R.Dense(torch.randn(b, *shape, generator=gen)),
    ]
    onehot = [
        R.OneHot(torch.randint(0, v, (b, t), generator=gen), torch.randn(b, t, c, generator=gen), v),
        R.Factored(torch.randn(b, 1, t, v, generator=gen), torch.randn(b, 1, t, c, generator=gen), (v, c)),
    ]
    for uses in (reps, onehot):
        guarded = ParamGrad(uses, ghost=True).sq_norm().double()
        exact = _exact_sq_norms(uses)
        assert (guarded >= exact).all()
        assert (guarded <= exact * (1 + float_guard.LOOSE) + 1e-6).all()


def test_grams_that_overflow_float32_are_recomputed_in_float64():
    """Entries of 1e11 over 64 features: Gram products of ~1e45 are inf in float32 (inf - inf = NaN
    for a cancelling sample), while the gradient itself is finite."""
    gen = torch.Generator().manual_seed(0)
    left = torch.randn(3, 1, 2, 64, generator=gen) * 1e11
    right = torch.randn(3, 1, 2, 4, generator=gen) * 1e5
    right[:, :, 1] = -0.5 * right[:, :, 0]
    left[:, :, 1] = left[:, :, 0]
    rep = R.Factored(left, right, (64, 4))
    guarded = ParamGrad([rep], ghost=True).sq_norm()
    exact = _exact_sq_norms([rep])
    assert torch.isfinite(guarded).all()
    assert (guarded.double() >= exact).all() and (guarded.double() <= exact * 1.001).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_scale_cast_to_half_precision_never_grows(dtype):
    """1 + 0.6 ulp rounds to nearest up to 1 + 1 ulp (2⁻⁷ in bfloat16): the sample's contribution
    would grow past its clip factor. The cast rounds toward zero instead."""
    ulp = torch.finfo(dtype).eps
    scale = torch.tensor([1 + 0.6 * ulp, 0.5 + 0.3 * ulp], dtype=torch.float32)
    rep = R.Dense(torch.ones(2, 3, dtype=dtype))
    out = R.clipped_sum(R.Dense(rep.grad[:1]), scale[:1]).double()
    assert (out <= scale[0].double()).all() and (out > scale[0].double() - 2 * ulp).all()
    both = R.clipped_sum(rep, scale).double()
    assert (both <= scale.double().sum()).all()


def _underflowing_row(c: int, frac: float, dtype=torch.float32) -> torch.Tensor:
    """c − 1 entries x whose squares round to 0 (below half the subnormal spacing) and one entry
    b with b² = frac·c·x²: the Gram entry loses a share 1/(1 + frac) of the row's squared norm."""
    info = torch.finfo(dtype)
    x = float(torch.tensor((0.499 * info.smallest_normal * info.eps) ** 0.5, dtype=dtype))
    row = torch.full((c,), x, dtype=dtype)
    row[0] = float(torch.tensor((frac * c * x * x) ** 0.5, dtype=dtype))
    return row


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("c, frac", [(4096, 1.0), (65536, 4.0)])
def test_products_that_underflow_over_many_features_are_bounded(dtype, c, frac):
    """Found by the review of this bound: the float32 Gram read 0.81 of the exact norm (released
    at 1.11 R through make_private) while the underflow allowance did not grow with the width."""
    left = _underflowing_row(c, frac, dtype).view(1, 1, 1, c)
    right = torch.full((1, 1, 1, 4), 1e18, dtype=dtype)
    reps = [R.Factored(left, right, (c, 4))]
    guarded = ParamGrad(reps, ghost=True).sq_norm()
    assert (guarded.double() >= _exact_sq_norms(reps)).all()
    lookup = [R.OneHot(torch.zeros(1, 1, dtype=torch.long), _underflowing_row(c, frac, dtype).view(1, 1, c), 3)]
    assert (ParamGrad(lookup, ghost=True).sq_norm().double() >= _exact_sq_norms(lookup)).all()


def test_an_underflowing_sample_is_clipped_through_make_private():
    c, r = 65536, 1e-3
    model, opt, loader = _noise_free(nn.Linear(c, 4, bias=False), TensorDataset(torch.zeros(16, 1, c)), r)
    (x,) = next(b for b in loader if len(b[0]))
    x = torch.zeros_like(x)
    x[0, 0] = _underflowing_row(c, 4.0)
    (1e18 * model(x)[0].sum()).backward()
    opt.step()
    released = next(p for p in model.parameters()).grad.double().norm().item() / r
    assert released <= 1 + 1e-5  # 1.11 R with a width-blind underflow allowance (unclipped: 30 R)


@pytest.mark.parametrize("kind", ["dense", "instantiated"])
def test_a_dense_norm_of_underflowing_squares_is_never_zero(kind):
    """Found by the independent audit of the bf16 convolution path: on the dense (instantiation)
    path, a sample whose entries all square below float32's range got norm 0, so clip factor 1,
    and added 1.72-1.83 R to the sum at R = 1e-37. Accumulated in float64 and rounded up, the
    norm is at least the exact one and the released sum stays within R."""
    g = torch.Generator().manual_seed(0)
    values = (torch.rand(4, 3, 5, generator=g) + 0.5) * 1e-39  # subnormal: squares underflow in float32
    if kind == "dense":
        rep = R.Dense(values)
    else:  # a Linear's factors (T = 3) whose products are representable, their squares not
        left = (torch.rand(4, 1, 3, 2, generator=g) + 0.5) * 1e-20
        right = (torch.rand(4, 1, 3, 5, generator=g) + 0.5) * 1e-20
        rep = R.Factored(left, right, (2, 5))
    param = ParamGrad([rep], ghost=False)
    sq = param.sq_norm()
    if kind == "dense":  # the exact squared norms, in float64, from the values themselves
        exact = values.double().flatten(1).square().sum(1)
    else:
        exact = torch.einsum("bgti,bgtj->bij", rep.left.double(), rep.right.double()).flatten(1).square().sum(1)
    assert (sq.double() >= exact).all() and (sq > 0).all()
    r = 1e-37
    scale = (r / sq.double().sqrt()).clamp(max=1.0).float()
    for i in range(4):  # each sample's contribution to the released sum, alone
        alone = torch.zeros(4)
        alone[i] = scale[i]
        assert param.clipped_sum(alone).double().norm().item() <= r * (1 + 1e-6)


def test_a_half_precision_parameter_is_noised_in_float32_then_cast():
    """The mechanism for a bfloat16 parameter is float32: sum + noise there, one cast after. In
    the parameter's dtype the sum was rounded before the noise (a sample could read (1 + 2⁻⁹) R)."""
    from dpzoo.privacy.distributed import noised_all_reduce

    p = torch.zeros(4096, dtype=torch.bfloat16)
    summed = torch.randn(4096, generator=torch.Generator().manual_seed(1)) / 3
    out = noised_all_reduce(p, summed, 1.0, torch.Generator().manual_seed(0))
    noise = torch.empty(4096).normal_(0.0, 1.0, generator=torch.Generator().manual_seed(0))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, (summed + noise).to(torch.bfloat16))
    assert torch.equal(noised_all_reduce(p, None, 0.0), p)


def test_a_bfloat16_model_releases_the_float32_mechanism_through_make_private():
    from dpzoo.grad_norms.half import round_toward_zero

    """A bfloat16 Linear trained through make_private: its gradient is the cast of (the float64
    brute-force clipped sum + float32 noise from the seeded generator), within the float32 sum's
    rounding; the clip factors of bfloat16 factors are rounded toward zero to bfloat16 (grad_norms/half.py)."""
    torch.manual_seed(0)
    model = nn.Linear(64, 8).to(torch.bfloat16)
    data = TensorDataset(torch.randn(32, 64).to(torch.bfloat16) * 4)
    r, sigma = 0.7, 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = dpzoo.PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
            data_loader=DataLoader(data, batch_size=8),
            noise_multiplier=sigma,
            max_grad_norm=r,
            loss_reduction="sum",
            noise_seed=3,
            sample_seed=1,
            self_check=False,
        )
    (x,) = next(b for b in loader if len(b[0]) > 1)
    w = torch.randn(8, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)  # a linear loss:
    reference = [p.detach().double().clone().requires_grad_() for p in model.parameters()]  # output rounding
    per_sample = []  # does not reach its gradient
    for row in x:
        out = torch.nn.functional.linear(row.double(), *reference)
        per_sample.append(torch.autograd.grad((out * w.double()).sum(), reference))
    (model(x) * w).sum().backward()
    opt.step()
    noises = seeded_noise(list(model.parameters()), sigma * r, torch.Generator().manual_seed(3))
    for i, (p, noise) in enumerate(zip(model.parameters(), noises)):
        norms = [torch.sqrt(sum(g.square().sum() for g in grads)) for grads in per_sample]
        factors = round_toward_zero(torch.tensor([min(1.0, r / float(n)) for n in norms]), torch.bfloat16)
        clipped = sum(g[i] * float(c) for g, c in zip(per_sample, factors))
        expected = (clipped.float() + noise).double()
        assert p.grad.dtype == torch.bfloat16
        # one bfloat16 rounding of the float32 value (2⁻⁸ relative), not two
        assert torch.allclose(p.grad.double(), expected, rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("launch", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_a_float32_dense_norm_is_an_upper_bound_and_tight(seed, launch, monkeypatch):
    """Dense squared norms are summed in float32 (no float64 copy) and taken up by their rounding
    bound: every sample's is at least the exact sum of squares (float32 row sums round below it
    about half the time), within 1e-4 of it on ordinary values, and a sample of subnormal,
    huge or non-finite values gets its float64 sum. ``launch``: the GPU's runs of 1,024 entries."""
    from dpzoo.grad_norms import half
    from dpzoo.grad_norms.rounding import LAUNCH_DENSE_CHUNK, dense_chunk, dense_sq_norm, round_up

    if launch:
        monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})
    g = torch.Generator().manual_seed(seed)
    shape = (512, *[int(n) for n in torch.randint(1, 40, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g)])
    if launch:
        shape = (64, LAUNCH_DENSE_CHUNK * (seed + 1) + 37 * seed)  # whole runs, and a remainder
        assert dense_chunk(torch.zeros(1)) == LAUNCH_DENSE_CHUNK
    grad = torch.randn(shape, generator=g) * torch.exp(4 * torch.randn(shape[0], *[1] * (len(shape) - 1), generator=g))
    grad[0] = (torch.rand(shape[1:], generator=g) + 0.5) * 1e-39  # squares underflow in float32
    grad[1] = (torch.rand(shape[1:], generator=g) + 0.5) * 1e25  # squares overflow in float32
    grad[2].view(-1)[0] = float("inf")
    exact = grad.double().flatten(1).square().sum(1)
    sq = dense_sq_norm(grad)
    assert sq.dtype == torch.float32
    ok = torch.isfinite(exact)
    assert (sq.double()[ok] >= exact[ok]).all()
    assert (sq.double()[3:] <= exact[3:] * (1 + 1e-4)).all()
    assert 0 < sq[0] == round_up(exact[:1], torch.float32)[0]  # summed in float64, rounded up once
    assert torch.isinf(sq[1]) and torch.isinf(sq[2])  # 1e50 and more: beyond float32, as before
    assert dense_sq_norm(torch.tensor([[2.0**-63, 2.0**-149]])).item() > 2.0**-126  # the float64 sum's own rounding, up
    assert dense_sq_norm(torch.zeros(0, 3, 4)).shape == (0,) == dense_sq_norm(torch.zeros(0, 5)).shape  # an empty rank
    assert dense_sq_norm(torch.zeros(0, 96, 64)).shape == (0,)  # whole runs of an empty rank (found by a review)
    assert torch.equal(dense_sq_norm(torch.zeros(2, 0)), torch.zeros(2))  # no entries (a review: division by 0)
    wide = torch.randn(4, 3, 5, generator=g, dtype=torch.float64)  # float64 gradients: summed as they are
    assert torch.allclose(dense_sq_norm(wide), wide.flatten(1).square().sum(1), rtol=1e-15)


def test_small_dense_parameters_are_normed_as_one_row_and_the_total_stays_an_upper_bound(monkeypatch):
    """total_sq_norms (what the DP step clips by): parameters whose gradient is one small dense use
    (biases, norm scales, in float32, bfloat16 or float64) are normed together, one norm per dtype,
    and the total over every parameter (large dense, ghost, several uses) is at least the exact
    per-sample ‖g‖² (float64 brute force) and within 1e-4 of it."""
    from dpzoo.grad_norms import param_grad

    g = torch.Generator().manual_seed(11)
    b = 6
    small = [
        torch.randn(b, 7, generator=g),
        torch.randn(b, 3, 4, generator=g).bfloat16(),
        torch.randn(b, 5, generator=g),
    ]
    small[2][0] = 1e-40  # a sample whose squares underflow in float32: float64 fallback inside the shared row
    small64 = torch.randn(b, 9, generator=g, dtype=torch.float64)
    big = torch.randn(b, 3 * param_grad.SMALL_DENSE, generator=g)  # normed on its own
    left, right = torch.randn(b, 1, 5, 30, generator=g), torch.randn(b, 1, 5, 20, generator=g)
    grads = [ParamGrad([R.Dense(t)]) for t in (*small, small64, big)]
    grads.append(ParamGrad([R.Factored(left, right, (30, 20))], ghost=True))
    grads.append(ParamGrad([R.Dense(small[0]), R.Dense(-0.5 * small[0])]))  # two uses, summed first
    calls = []
    real = param_grad.dense_sq_norms
    monkeypatch.setattr(
        param_grad, "dense_sq_norms", lambda ts: calls.append(sorted(tuple(t.shape) for t in ts)) or real(ts)
    )
    total = torch.stack([s.double() for s in param_grad.total_sq_norms(grads)]).sum(0)
    exact = sum(t.double().flatten(1).square().sum(1) for t in (*small, small64, big))
    exact = exact + torch.einsum("btr,btc->brc", left[:, 0].double(), right[:, 0].double()).flatten(1).square().sum(1)
    exact = exact + (0.5 * small[0].double()).square().sum(1)
    assert (total >= exact).all() and (total <= exact * (1 + 1e-4)).all()
    # one call (one host read): a shared row for the small float32 (and upcast bfloat16) parameters and
    # the summed two-use one (7 + 12 + 5 + 7 entries a sample), one for the float64 one, the large one's own
    assert calls == [sorted([(b, 3 * param_grad.SMALL_DENSE), (b, 9), (b, 31)])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_position_ghost_norms_and_cross_terms_need_no_product_per_feature_chunk(dtype, monkeypatch):
    """At T = 1 (a classifier head, ResNet's last stage) the Gram entries are dot products summed by
    chunks of GRAM_CHUNK features without a GEMM per chunk; norms and cross terms equal the float64
    ones within the rounding of their 1000-term sums, and the guarded norm is never below the exact."""
    gen = torch.Generator().manual_seed(4)
    b, r, c = 5, 1000, 300
    u = R.Factored(*(torch.randn(b, 2, 1, n, generator=gen).to(dtype) for n in (r, c)), (2, r, c))
    v = R.Factored(u.left.clone(), -0.9 * u.right, (2, r, c))  # cancels most of u
    products = []
    real = R.product
    monkeypatch.setattr(R, "product", lambda x, y: products.append(x.shape) or real(x, y))
    got_sq, got_inner = R.sq_norm(u, ghost=True).double(), R.inner(u, v, ghost=True).double()
    assert products == []

    def grad(rep):
        return torch.einsum("bgtr,bgtc->bgrc", rep.left.double(), rep.right.double()).flatten(1)

    exact_sq, exact_inner = grad(u).square().sum(1), (grad(u) * grad(v)).sum(1)
    scale = grad(u).square().sum(1)  # the size of the terms the rounding is relative to
    assert ((got_sq - exact_sq).abs() <= 1e-4 * scale).all()
    assert ((got_inner - exact_inner).abs() <= 1e-4 * scale).all()
    guarded = ParamGrad([u, v], ghost=True).sq_norm().double()
    assert (guarded >= (grad(u) + grad(v)).square().sum(1)).all()


def test_dense_norms_of_many_gradients_read_the_host_once_and_equal_one_by_one(monkeypatch):
    """dense_sq_norms: each result is dense_sq_norm's (float64 fallback for the samples whose bound is
    loose included), and where no sample needs the fallback all gradients cost one host read."""
    from dpzoo.grad_norms.rounding import dense_sq_norm, dense_sq_norms

    g = torch.Generator().manual_seed(8)
    grads = [torch.randn(6, 40, generator=g), torch.randn(6, 3, 70, generator=g), torch.randn(6, 5, generator=g)]
    grads.append(torch.randn(6, 2, 32, generator=g) * 1e-3)  # whole runs only
    grads += [torch.randn(6, 9, generator=g, dtype=torch.float64), torch.randn(6, 11, generator=g).bfloat16()]
    grads.append(torch.zeros(0, 4))  # an empty rank
    reads = []

    def counted():
        for name in ("tolist", "__bool__", "item"):
            real = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _r=real, _n=name: reads.append(_n) or _r(t, *a))

    for fire in (False, True):
        if fire:  # a subnormal sample, an infinite one, an all-zero gradient: float64 sums
            grads[1][2], grads[1][4, 0, 0], grads[2] = 1e-40, float("inf"), torch.zeros(6, 5)
        expected = [dense_sq_norm(t) for t in grads]
        reads.clear()
        counted()
        got = dense_sq_norms(grads)
        monkeypatch.undo()
        assert fire or reads == ["__bool__"], reads
        for e, x in zip(expected, got):
            assert e.dtype == x.dtype and torch.equal(e, x)
    assert got[1][2] > 0 and torch.isinf(got[1][4]) and (got[2] == 0).all()


def test_a_parameters_uses_are_settled_once_so_the_planners_choices_keep_their_uses(monkeypatch):
    """total_sq_norms settles a parameter's uses, then (for one not dense) takes its sq_norm: the
    uses are reordered by the first settling, so a second one would read the planner's choices
    against the wrong uses and instantiate a use planned on the ghost path (found by a review)."""
    from dpzoo.grad_norms import param_grad

    gen = torch.Generator().manual_seed(2)
    uses = [R.Factored(torch.randn(3, 1, t, 40, generator=gen), torch.randn(3, 1, t, 30, generator=gen), (40, 30))
            for t in (9, 8, 2)]  # fmt: skip
    g = ParamGrad(uses, choices=[True, False, False])  # the first on the ghost path, the others instantiated
    total = param_grad.total_sq_norms([g])[0].double()
    assert [type(r).__name__ for r in g.reps] == ["Dense", "Factored"] and g.reps[1] is uses[0]
    exact = sum(torch.einsum("btr,btc->brc", u.left[:, 0].double(), u.right[:, 0].double()) for u in uses)
    assert (total >= exact.flatten(1).square().sum(1)).all()


@pytest.mark.parametrize("seed", range(4))
def test_ghost_guards_stacked_on_a_cpu_equal_the_guards_one_by_one(seed):
    """checked_and_bounds: single uses of one dtype and batch bounded as one stack give every item's
    norm and U exactly as checked_and_bound alone, items with a sample to redo in float64 (cancelling,
    underflowing, infinite rows) included, beside multi-use, bfloat16 and float64 items."""
    gen = torch.Generator().manual_seed(seed)
    b = 5

    def factored(t, r, c, dtype=torch.float32, scale=1.0):
        left = torch.randn(b, 1, t, r, generator=gen) * scale
        return R.Factored(left.to(dtype), torch.randn(b, 1, t, c, generator=gen).to(dtype), (c, r))

    items = [[factored(*(int(x) for x in torch.randint(1, 40, (3,), generator=gen)))] for _ in range(5)]
    items += [
        [factored(3, 7, 5, torch.bfloat16)],
        [factored(3, 7, 5, torch.bfloat16)],
        [factored(2, 4, 3, torch.float64)],
    ]
    items.append(_cancelling_uses(gen, b, 4, 64, 3, 0.02, "factored"))  # two uses
    cancel = factored(2, 300, 3)
    cancel.left[1, :, 1] = cancel.left[1, :, 0]
    cancel.right[1, :, 1] = -(1 - 1e-4) * cancel.right[1, :, 0]
    items += [[cancel], [factored(2, 9, 3, scale=1e-25)]]
    tiny = factored(3, 6, 4)
    tiny.left[2, 0, 1] = float("inf")
    items.append([tiny])
    # each item's computed ghost norm, every use and cross term (as ParamGrad forms it before the guard)
    totals = [
        (
            sum(R.sq_norm(r, ghost=True) for r in reps)
            + 2 * sum(R.inner(u, v, ghost=True) for u, v in zip(reps, reps[1:]))
        ).clamp_min(0)
        for reps in items
    ]
    got = float_guard.checked_and_bounds(list(zip(items, totals)))
    for reps, total, (sq, u) in zip(items, totals, got):
        want_sq, want_u = float_guard.checked_and_bound(reps, total)
        assert sq.dtype == want_sq.dtype and torch.equal(sq.nan_to_num(), want_sq.nan_to_num())
        assert torch.equal(sq.isnan(), want_sq.isnan()) and torch.equal(u.nan_to_num(), want_u.nan_to_num())


@pytest.mark.parametrize("seed", range(3))
def test_stacked_ghost_guards_bound_the_per_sample_norms_of_a_brute_force_loop(seed):
    """total_sq_norms on a CPU (the stacked guards): every ghost-path parameter's norm is at least the
    exact one, sample by sample from Σ_t L_tᵀ R_t formed in float64 by a plain loop, and at most
    LOOSE above it (or at the floor of a sample that cancels); crafted cancelling and tiny samples included."""
    from dpzoo.grad_norms.param_grad import total_sq_norms

    gen = torch.Generator().manual_seed(100 + seed)
    b, grads, factors = 4, [], []
    for k in range(6):
        t, r, c = (int(x) for x in torch.randint(1, 24, (3,), generator=gen))
        left, right = torch.randn(b, 1, t, r, generator=gen), torch.randn(b, 1, t, c, generator=gen)
        if k == 0 and t > 1:  # sample 1's two positions cancel up to 1e-3
            left[1, 0, 1], right[1, 0, 1] = left[1, 0, 0], -(1 - 1e-3) * right[1, 0, 0]
        if k == 1:
            left[2] *= 1e-22  # products near float32's smallest normal
        factors.append((left, right))
        grads.append(ParamGrad([R.Factored(left, right, (r, c))], ghost=True))
    got = total_sq_norms(grads)
    for (left, right), sq in zip(factors, got):
        exact, u = torch.zeros(b, dtype=torch.float64), torch.zeros(b, dtype=torch.float64)
        for i in range(b):
            rows = [(left[i, 0, s].double(), right[i, 0, s].double()) for s in range(left.shape[2])]
            exact[i] = sum(torch.outer(x, y) for x, y in rows).square().sum()
            u[i] = sum(x.norm() * y.norm() for x, y in rows)
        assert (sq.double() >= exact).all()
        # tight, but for a gradient that cancels below the floor (GHOST_FLOOR · U)², clipped as if at it
        floor = (float_guard.GHOST_FLOOR * u * (1 + 1e-5)).square()
        assert (sq.double() <= torch.maximum(exact * (1 + float_guard.LOOSE), floor)).all()
