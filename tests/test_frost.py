"""DP-FROST (issue 6): PGMs against brute force, Lemma 3's sensitivities, PGM-EST against the
hand-computed and numerically maximised likelihood, PSEL selection, and the budget split."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from grad_reference import per_sample_grads
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpzoo
from dpzoo import frost
from dpzoo.frost import magnitudes as MG
from dpzoo.frost.selection import PartitionGradientMeasure

# -- PGM-EST -------------------------------------------------------------------------------


def test_pgm_est_single_iteration_is_v_over_q():
    v = torch.tensor([[0.2, 0.05, 0.4]])
    nu, lam = frost.pgm_est(v, torch.ones_like(v, dtype=torch.bool), 0.02)
    assert torch.allclose(nu, v[0].double() / 0.02) and lam.tolist() == [0.02]


def test_pgm_est_hand_computed_two_iterations():
    """Partition 0 selected after t = 1; partition 1 observed twice. The MLE fits t = 2 exactly:
    ν_1 = v_11 / q, λ_2 = v_21 / ν_1, ν_0 = v_10 / q."""
    q = 0.05
    v = torch.tensor([[0.30, 0.10], [0.0, 0.07]], dtype=torch.float64)
    mask = torch.tensor([[True, True], [False, True]])
    nu, lam = frost.pgm_est(v, mask, q)
    assert nu.tolist() == pytest.approx([0.30 / q, 0.10 / q])
    assert lam.tolist() == pytest.approx([q, 0.07 / (0.10 / q)])


def test_pgm_est_is_the_maximum_likelihood():
    """Against a numerical maximisation of the Gaussian likelihood (λ_1 fixed, unequal noise)."""
    g = torch.Generator().manual_seed(0)
    t, m, q = 3, 5, 0.1
    true_nu = torch.rand(m, generator=g, dtype=torch.float64) + 0.5
    true_lam = torch.tensor([q, 0.12, 0.08], dtype=torch.float64)
    mask = torch.ones(t, m, dtype=torch.bool)
    mask[1, 0] = mask[2, 0] = mask[2, 3] = False
    s = torch.tensor([0.01, 0.02, 0.015], dtype=torch.float64)
    v = true_lam[:, None] * true_nu + s[:, None] * torch.randn(t, m, generator=g, dtype=torch.float64)
    nu, lam = frost.pgm_est(v, mask, q, s, iterations=20000, tol=1e-15)

    def nll(nu_, lam_rest):
        lam_ = torch.cat([torch.tensor([q], dtype=torch.float64), lam_rest])
        r = (v - lam_[:, None] * nu_) / s[:, None]
        return 0.5 * (r.pow(2) * mask).sum()

    x_nu = nu.clone().requires_grad_(True)
    x_lam = lam[1:].clone().requires_grad_(True)
    gnu, glam = torch.autograd.grad(nll(x_nu, x_lam), (x_nu, x_lam))
    assert gnu.abs().max() < 1e-6 and glam.abs().max() < 1e-6  # stationary point
    # and it is the maximum: a numerical optimiser from elsewhere does not beat it
    y_nu = (true_nu * 1.3).clone().requires_grad_(True)
    y_lam = torch.full((t - 1,), 0.2, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([y_nu, y_lam], max_iter=500, tolerance_grad=1e-14, tolerance_change=1e-16)

    def closure():
        opt.zero_grad()
        loss = nll(y_nu, y_lam)
        loss.backward()
        return loss

    opt.step(closure)
    assert nll(nu, lam[1:]) <= nll(y_nu.detach(), y_lam.detach()) + 1e-9
    assert torch.allclose(nu, y_nu.detach(), rtol=1e-5)


def test_pgm_variance_lemma_6():
    lam = torch.tensor([0.02, 0.03], dtype=torch.float64)
    s = torch.tensor([0.5, 0.25], dtype=torch.float64)
    mask = torch.tensor([[True, True], [False, True]])
    var = frost.pgm_variance(lam, mask, s)
    assert var.tolist() == pytest.approx([0.25 / 0.02**2, 1 / (0.02**2 / 0.25 + 0.03**2 / 0.0625)])


# -- magnitudes ----------------------------------------------------------------------------


def _definition(grads, method, alpha, clip, sizes):
    """Def. 7-8 written out example by example."""
    total = [torch.zeros(n, dtype=torch.float64) for n in sizes]
    for b in range(grads[0].shape[0]):
        parts = [g[b] for g in grads]
        if method != "mg":
            parts = [p / n ** (1 / alpha) for p, n in zip(parts, sizes)]
        if method == "mgna":
            parts = [p.abs() for p in parts]
        full = torch.cat(parts)
        thr = clip if method == "mg" else clip / (sum(sizes) / len(sizes)) ** (1 / alpha)
        c = min(1.0, thr / full.norm(p=alpha).item())
        total = [t + c * p for t, p in zip(total, parts)]
    out = torch.stack([t.norm(p=alpha) for t in total])
    if method == "mg":
        out = out / torch.tensor(sizes, dtype=torch.float64) ** (1 / alpha)
    return out


@pytest.mark.parametrize("method", frost.METHODS)
@pytest.mark.parametrize("alpha", [1, 2])
def test_pgms_follow_definition_8(method, alpha):
    g = torch.Generator().manual_seed(1)
    sizes = [3, 10, 6]
    grads = [torch.randn(7, n, generator=g, dtype=torch.float64) * (i + 1) for i, n in enumerate(sizes)]
    got = MG.pgms(MG.clipped_partition_sums(grads, method, alpha, 0.7, sizes), method, alpha, sizes)
    assert torch.allclose(got, _definition(grads, method, alpha, 0.7, sizes))


@pytest.mark.parametrize("method", frost.METHODS)
@pytest.mark.parametrize("alpha", [1, 2])
def test_lemma_3_sensitivity_bounds_one_example(method, alpha):
    """Adding one example moves the PGM vector by at most Δ in ℓ2, on adversarial-ish draws."""
    g = torch.Generator().manual_seed(2)
    sizes = [2, 9, 5, 30]
    delta = frost.sensitivity(method, alpha, 1.0, sizes)
    worst = 0.0
    for trial in range(200):
        grads = [torch.randn(5, n, generator=g, dtype=torch.float64) for n in sizes]
        extra = [torch.randn(1, n, generator=g, dtype=torch.float64) * 10 ** (trial % 4) for n in sizes]
        if trial % 3 == 0:  # all of the new example's mass in the smallest partition
            extra = [e * (i == 0) for i, e in enumerate(extra)]
        base = MG.pgms(MG.clipped_partition_sums(grads, method, alpha, 1.0, sizes), method, alpha, sizes)
        more = MG.pgms(
            MG.clipped_partition_sums([torch.cat([a, b]) for a, b in zip(grads, extra)], method, alpha, 1.0, sizes),
            method,
            alpha,
            sizes,
        )
        worst = max(worst, (more - base).norm().item())
    assert worst <= delta * (1 + 1e-9)
    assert worst > 0.3 * delta  # the bound is not vacuous


def test_sensitivities_are_lemma_3():
    sizes = [4, 16, 100]
    assert frost.sensitivity("mg", 1, 2.0, sizes) == pytest.approx(2.0 / 4)
    assert frost.sensitivity("mg", 2, 2.0, sizes) == pytest.approx(2.0 / 2)
    assert frost.sensitivity("mgn", 1, 2.0, sizes) == pytest.approx(2.0 / 40)
    assert frost.sensitivity("mgna", 2, 2.0, sizes) == pytest.approx(2.0 / math.sqrt(40))


# -- models --------------------------------------------------------------------------------


class Branches(nn.Module):
    """K equal Linear branches scaled by fixed constants: branch k's gradient grows with c_k."""

    def __init__(self, scales, d_in=8, classes=4):
        super().__init__()
        self.branches = nn.ModuleList(nn.Linear(d_in, classes) for _ in scales)
        self.register_buffer("scales", torch.tensor(scales, dtype=torch.float32))
        self.classifier = nn.Linear(d_in, classes)

    def forward(self, x):
        return self.classifier(x) + sum(s * b(x) for s, b in zip(self.scales, self.branches))


def _data(n=400, d=8, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return TensorDataset(x, y)


def test_measured_pgms_equal_brute_force_per_sample_gradients():
    torch.manual_seed(0)
    model = Branches([0.5, 1.0, 2.0]).double()
    ds = TensorDataset(*[t.double() if t.is_floating_point() else t for t in _data(12).tensors])
    parts = frost.default_partitions(model)
    idx = [0, 3, 4, 7, 11]
    for method in frost.METHODS:
        for alpha in (1, 2):
            got = PartitionGradientMeasure(model, ds, None, frost.default_loss, method, alpha, 0.3, 2)(parts, idx)
            x, y = ds.tensors
            grads = per_sample_grads(
                model, lambda m, x, y: F.cross_entropy(m(x), y, reduction="sum"), {"x": x[idx], "y": y[idx]}, len(idx)
            )
            pg = [torch.stack([torch.cat([g[n].flatten() for n in p.params]) for g in grads]) for p in parts]
            ref = _definition(pg, method, alpha, 0.3, [p.size for p in parts])
            assert torch.allclose(got, ref, rtol=1e-8), (method, alpha)
    assert all(p.requires_grad for p in model.parameters())  # flags restored


def test_measured_pgms_on_a_transformer_match_brute_force():
    torch.manual_seed(0)
    card = dpzoo.model_card("bert-base")
    model = dpzoo.load("bert-base", **card.test_overrides).double()
    ids = torch.randint(0, card.example_input["vocab_size"], (5, card.example_input["seq_len"]))
    y = torch.randint(0, card.test_overrides["num_classes"], (5,))
    ds = TensorDataset(ids, y)
    parts = frost.default_partitions(model)
    got = PartitionGradientMeasure(model, ds, None, frost.default_loss, "mgna", 1, 1.0, 2)(parts, list(range(5)))
    model.eval()
    grads = per_sample_grads(
        model, lambda m, i, y: F.cross_entropy(m(input_ids=i).logits, y, reduction="sum"), {"i": ids, "y": y}, 5
    )
    pg = [torch.stack([torch.cat([g[n].flatten() for n in p.params]) for g in grads]) for p in parts]
    ref = _definition(pg, "mgna", 1, 1.0, [p.size for p in parts])
    assert torch.allclose(got, ref, rtol=1e-7)


def _true_order(model, ds, parts, method="mgna", alpha=1):
    pg = PartitionGradientMeasure(model, ds, None, frost.default_loss, method, alpha, 1.0, 64)(
        parts, list(range(len(ds)))
    )
    return [parts[i].name for i in torch.argsort(pg, descending=True).tolist()]


@pytest.mark.parametrize("single", [True, False])
def test_zero_noise_selects_the_largest_true_magnitudes(single):
    torch.manual_seed(0)
    scales = [0.1, 3.0, 0.3, 0.05, 2.0, 0.2, 1.0, 0.15, 0.5, 0.08]
    model = Branches(scales)
    ds = _data()
    loader = DataLoader(ds, batch_size=40)
    head = ["classifier.weight", "classifier.bias"]
    parts = frost.default_partitions(model, exclude=head)
    expected = _true_order(model, ds, parts)[:3]
    with pytest.warns(UserWarning, match="not differentially private"):
        sel = frost.select(
            model,
            loader,
            8.0,
            1e-5,
            ratio=0.3,
            epochs=1,
            sample_rate=1.0,
            iterations=3,
            single=single,
            selection_noise_multiplier=0.0,
            seed=0,
        )
    assert [p.name for p in sel.selected] == expected or set(p.name for p in sel.selected) == set(expected)
    assert set(expected) == {"branches.1", "branches.4", "branches.6"}  # the largest scales
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert (
        trainable == set(sel.parameter_names) == {f"{b}.{w}" for b in expected for w in ("weight", "bias")} | set(head)
    )


def test_composed_epsilon_of_selection_and_training_meets_the_target():
    torch.manual_seed(0)
    model = Branches([1.0] * 6)
    ds = _data(300)
    loader = DataLoader(ds, batch_size=30)
    eps, delta = 3.0, 1e-4
    sel = frost.select(model, loader, eps, delta, ratio=0.5, epochs=2, seed=1, sample_rate=0.1)
    assert sel.accountant.steps == 5 and sel.accountant.history == [[sel.selection_noise_multiplier, 0.1, 5]]
    eps_sel = sel.accountant.get_epsilon(delta)
    assert 0 < eps_sel < eps
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    engine, model, opt, dl = sel.make_private(module=model, optimizer=opt, data_loader=loader)
    assert engine.noise_multiplier == sel.noise_multiplier
    for _ in range(2):
        for x, y in dl:
            if len(x):
                F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert engine.steps == sel.sgd_steps + sel.iterations
    total = engine.get_epsilon(delta)
    assert eps - 0.05 <= total <= eps  # ComputeSigma's tolerance is 0.01 in ε
    # DP-SGD alone spends about r_ε · ε (Algorithm 3)
    from dpzoo.privacy.accounting.accountant import Accountant

    sgd = Accountant("rdp", [[sel.noise_multiplier, sel.sgd_sample_rate, sel.sgd_steps]]).get_epsilon(delta)
    assert 0.9 * eps - 0.02 <= sgd <= 0.9 * eps
    engine.detach()


def test_engine_calibrates_after_a_spent_history():
    """make_private(target_epsilon=…) with an accountant that already holds selection composes."""
    from dpzoo.privacy.accounting.accountant import Accountant

    acc = Accountant("rdp", [[3.0, 0.2, 5]])  # spends about ε = 0.8
    model = nn.Linear(8, 4)
    engine = dpzoo.PrivacyEngine(accountant=acc)
    _, opt, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(100), batch_size=10),
        target_epsilon=2.0,
        target_delta=1e-5,
        epochs=1,
    )
    alone = dpzoo.privacy.accounting.accountant.get_noise_multiplier(2.0, 1e-5, 0.1, 10)
    assert engine.noise_multiplier > alone  # less budget left, more noise
    engine.accountant.step(engine.noise_multiplier, 0.1, 10)
    assert engine.get_epsilon(1e-5) <= 2.0
    engine.detach()
    with pytest.raises(ValueError, match="already spends"):
        dpzoo.privacy.accounting.accountant.get_noise_multiplier(0.01, 1e-5, 0.1, 10, history=[[0.5, 1.0, 10]])


def test_selection_costs_a_small_fraction_of_an_epoch():
    torch.manual_seed(0)
    model = Branches([1.0, 2.0, 0.5, 0.2])
    ds = _data(2000)
    sel = frost.select(model, DataLoader(ds, batch_size=100), 8.0, 1e-5, epochs=1, sample_rate=0.02, seed=0)
    # T = 5 Poisson samples at q = 0.02: about 10% of one epoch's examples
    assert 0 < sel.samples_seen < 0.2 * len(ds)
    assert sel.selected_size <= 0.25 * sel.total_size


def test_bad_input_is_refused_clearly():
    model = Branches([1.0, 2.0])
    loader = DataLoader(_data(50), batch_size=10)
    with pytest.raises(dpzoo.DPZooError, match="two partitions"):
        frost.select(model, loader, 8.0, 1e-5, epochs=1, partitions=[["branches.0.weight"], ["branches.0.weight"]])
    with pytest.raises(dpzoo.DPZooError, match="in no partition"):
        frost.select(model, loader, 8.0, 1e-5, epochs=1, partitions={"a": ["branches.0.weight"]})
    with pytest.raises(dpzoo.DPZooError, match="ratio"):
        frost.select(model, loader, 8.0, 1e-5, ratio=0.0, epochs=1)
    with pytest.raises(dpzoo.DPZooError, match="always_train"):
        frost.select(model, loader, 8.0, 1e-5, epochs=1, always_train=["nope"])
    assert all(p.requires_grad for p in model.parameters())  # nothing frozen by a failed call


class BagOfTokens(nn.Module):
    def __init__(self, vocab=12, d=5, classes=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.classifier = nn.Linear(d, classes)

    def forward(self, ids):
        return self.classifier(self.emb(ids).mean(1))


def test_embedding_rows_coalesced_before_abs():
    """A token repeated in a sample: its row gradients add before |·| (row-sparse path)."""
    torch.manual_seed(0)
    model = BagOfTokens().double()
    ids = torch.tensor([[1, 1, 1, 2], [3, 4, 3, 3], [5, 5, 6, 1]])
    y = torch.tensor([0, 2, 1])
    ds = TensorDataset(ids, y)
    parts = frost.default_partitions(model)
    got = PartitionGradientMeasure(model, ds, None, frost.default_loss, "mgna", 1, 0.05, 2)(parts, [0, 1, 2])
    grads = per_sample_grads(model, lambda m, i, y: F.cross_entropy(m(i), y, reduction="sum"), {"i": ids, "y": y}, 3)
    pg = [torch.stack([torch.cat([g[n].flatten() for n in p.params]) for g in grads]) for p in parts]
    assert torch.allclose(got, _definition(pg, "mgna", 1, 0.05, [p.size for p in parts]))


def test_unseeded_selection_noise_is_secret_even_after_torch_manual_seed():
    """seed=None: the selection's noise and subsampling come from OS entropy, not from torch's
    global generator, which a script's torch.manual_seed makes predictable."""
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        model = Branches([1.0] * 6)
        loader = DataLoader(_data(200), batch_size=20)
        torch.manual_seed(123)  # the same global state before each selection
        sel = frost.select(model, loader, 3.0, 1e-4, ratio=0.5, epochs=1, sample_rate=0.2, iterations=2)
        runs.append(dict(sel.estimates))
    assert runs[0].keys() == runs[1].keys()
    assert runs[0] != runs[1]  # equal only if both drew the same noise: the old global-generator seed


def test_a_seeded_selection_warns_that_its_noise_is_not_secret():
    torch.manual_seed(0)
    model = Branches([1.0] * 4)
    loader = DataLoader(_data(100), batch_size=20)
    with pytest.warns(dpzoo.errors.ReproducibleNoiseWarning, match="seed=3: DP-FROST") as caught:
        frost.select(model, loader, 3.0, 1e-4, ratio=0.5, epochs=1, sample_rate=0.2, iterations=1, seed=3)
    assert all(w.filename == __file__ for w in caught if issubclass(w.category, dpzoo.errors.ReproducibleNoiseWarning))
