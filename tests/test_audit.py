"""The one-run privacy audit (Steinke, Nasr & Jagielski 2023): the bound on hand-checkable cases
and against a direct solve; dpzoo's engine stays below its claimed ε; the positive controls
(noise off; a path trained outside the engine, unclipped) exceed it."""

from __future__ import annotations

import json
import math
import warnings
from contextlib import contextmanager

import pytest
import torch

import dpzoo
from dpzoo.audit import AuditResult, digits_canary_task, epsilon_lower_bound, loss_score, one_run_p_value

# small enough for a CPU test, large enough that the controls can exceed ε = 2: with 200
# canaries the best possible bound (180 right guesses of 180, 95%, Bonferroni over 6) is 3.6
SMALL = dict(epsilon=2.0, delta=1e-5, canaries=200, epochs=5, seed=0, noise_seed=11, sample_seed=12)


@pytest.fixture(autouse=True)
def _one_thread():
    """A linear model on a few hundred inputs: threads only add overhead (and stall on a busy CPU)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@contextmanager
def _seeded_noise_ok():
    """The tests seed the engine's noise and sampling on purpose (determinism)."""
    with warnings.catch_warnings():
        cls = getattr(dpzoo.errors, "ReproducibleNoiseWarning", None)
        if cls is not None:
            warnings.simplefilter("ignore", cls)
        yield


# -- the bound ---------------------------------------------------------------------------------------
def _reference_p_value(m, r, v, eps, delta):
    """The theorem's right-hand side computed the slow way: exact binomial coefficients,
    f evaluated afresh at every shift i."""
    p = math.exp(eps) / (1 + math.exp(eps))

    def f(t):  # P[Binomial(r, p) >= t]
        return sum(math.comb(r, k) * p**k * (1 - p) ** (r - k) for k in range(max(t, 0), r + 1))

    if v == 0:
        return 1.0
    extra = max((f(v - i) - f(v)) / i for i in range(1, v + 1))
    return min(1.0, f(v) + 2 * m * delta * extra)


@pytest.mark.parametrize(
    "m,r,v,delta", [(50, 20, 18, 0.0), (50, 20, 18, 1e-3), (100, 30, 30, 1e-5), (40, 12, 10, 1e-4), (10, 10, 7, 0.0)]
)
def test_p_value_matches_direct_formula(m, r, v, delta):
    for eps in (0.0, 0.3, 1.0, 2.5, 6.0):
        assert one_run_p_value(m, r, v, eps, delta) == pytest.approx(
            _reference_p_value(m, r, v, eps, delta), rel=1e-9, abs=1e-15
        )


def test_p_value_at_zero_epsilon_is_a_fair_coin_tail():
    # ε = 0, δ = 0: every guess is a fair coin, P[v or more right of r] = Σ C(r, k) / 2^r
    for r, v in ((10, 7), (25, 20), (1, 1)):
        exact = sum(math.comb(r, k) for k in range(v, r + 1)) / 2**r
        assert one_run_p_value(100, r, v, 0.0, 0.0) == pytest.approx(exact, rel=1e-12)


@pytest.mark.parametrize("r", [10, 100, 1000])
def test_all_right_without_delta_has_a_closed_form(r):
    # δ = 0, v = r: p^r <= β  <=>  ε <= logit(β^(1/r))
    beta = 0.05
    x = beta ** (1 / r)
    assert epsilon_lower_bound(r, r, r, 0.0, beta) == pytest.approx(math.log(x / (1 - x)), abs=2e-6)


def test_bound_matches_a_direct_numeric_solve():
    # the last ε whose reference p-value is still <= β, scanning a grid of 0.01 then 1e-4
    for m, r, v, delta in ((60, 24, 22, 1e-4), (200, 20, 20, 1e-5), (30, 30, 25, 0.0)):
        eps, step = 0.0, 0.01
        while step >= 1e-4:
            while _reference_p_value(m, r, v, eps + step, delta) <= 0.05:
                eps += step
            step /= 10
        assert epsilon_lower_bound(m, r, v, delta, 0.05) == pytest.approx(eps, abs=1.5e-4)


def test_hand_checkable_cases():
    assert epsilon_lower_bound(100, 50, 0, 1e-5) == 0.0  # all guesses wrong
    assert epsilon_lower_bound(100, 0, 0, 1e-5) == 0.0  # no guess at all
    assert epsilon_lower_bound(100, 50, 25, 1e-5) == 0.0  # a coin's accuracy proves nothing
    assert epsilon_lower_bound(1000, 4, 4, 1e-5) == 0.0  # 4 right of 4: p = 1/16 > 0.05
    assert epsilon_lower_bound(1000, 5, 5, 0.0) > 0  # 5 of 5: 1/32 < 0.05
    assert one_run_p_value(100, 50, 0, 3.0, 1e-5) == 1.0


def test_bound_is_monotone():
    in_v = [epsilon_lower_bound(1000, 200, v, 1e-5) for v in range(100, 201, 5)]
    assert all(a <= b for a, b in zip(in_v, in_v[1:])) and in_v[0] == 0 and in_v[-1] > 3
    in_r = [epsilon_lower_bound(1000, r, r, 1e-5) for r in (10, 50, 100, 500, 1000)]
    assert all(a < b for a, b in zip(in_r, in_r[1:]))
    in_conf = [epsilon_lower_bound(1000, 100, 90, 1e-5, beta) for beta in (0.2, 0.05, 0.01, 0.001)]
    assert all(a > b for a, b in zip(in_conf, in_conf[1:]))
    in_delta = [epsilon_lower_bound(1000, 100, 90, d) for d in (0.0, 1e-6, 1e-4, 1e-3)]
    assert all(a >= b for a, b in zip(in_delta, in_delta[1:])) and in_delta[0] > in_delta[-1]


def test_reproduces_worked_values_of_the_paper():
    # two worked values reported for the paper's reference code (arXiv:2305.08846v1, as cited by
    # public code: App. D, m = 1000, r = 100, v = 75, δ = 1e-4 -> 0.673; §7, m = 1e5, r = 1510,
    # v = 1439, δ = 1e-5 -> 2.675, printed truncated), both at 95%
    assert epsilon_lower_bound(1000, 100, 75, 1e-4, 0.05) == pytest.approx(0.673, abs=5e-4)
    eps = epsilon_lower_bound(100_000, 1510, 1439, 1e-5, 0.05)
    assert 2.675 <= eps < 2.677


def test_bad_counts_raise_dpzoo_error():
    with pytest.raises(dpzoo.DPZooError, match="v .*<= r"):
        epsilon_lower_bound(10, 5, 6, 1e-5)
    with pytest.raises(dpzoo.DPZooError, match="r .*<= m"):
        one_run_p_value(10, 11, 3, 1.0, 1e-5)
    with pytest.raises(dpzoo.DPZooError, match="beta"):
        epsilon_lower_bound(10, 5, 5, 1e-5, beta=1.5)


# -- arguments ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(epsilon=0), "epsilon"),
        (dict(delta=2.0), "delta"),
        (dict(broken="no-clip"), "broken"),
        (dict(canaries=1), "canaries"),
        (dict(epochs=0), "epochs"),
        (dict(confidence=1.0), "confidence"),
        (dict(dataset=[(torch.zeros(2), 0)]), "model_fn"),
        (dict(dataset=[(torch.zeros(2), 0)], model_fn=lambda: torch.nn.Linear(2, 2), canaries=5), "canaries="),
    ],
)
def test_bad_arguments_raise_dpzoo_error(kwargs, match):
    with pytest.raises(dpzoo.DPZooError, match=match):
        dpzoo.audit(**kwargs)


def test_cli_bad_argument_is_a_one_line_error(capsys):
    from dpzoo.cli import main

    assert main(["audit", "--canaries", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dpzoo: error: canaries") and "\n" not in err


# -- audits of real training runs ------------------------------------------------------------------------
def _audit(**kw) -> AuditResult:
    with _seeded_noise_ok():
        return dpzoo.audit(**{**SMALL, **kw})


@pytest.mark.slow
def test_dpzoo_engine_bound_stays_below_its_claim():
    res = _audit()
    assert res.claimed_epsilon == pytest.approx(2.0, abs=0.02)  # the engine calibrated σ to ε = 2
    assert res.mechanism["noise_multiplier"] > 0.5
    assert res.epsilon_lower_bound <= res.claimed_epsilon and not res.exceeds
    assert res.verdict.startswith("bound below claim")
    assert res.max_auditable_epsilon > res.claimed_epsilon  # the audit could have refuted it
    assert res.test_accuracy > 0.8  # the model learned the digits
    assert res.canaries == 200 and 0 < res.included < 200 and res.correct <= res.guesses
    d = res.to_dict()
    json.dumps(d)
    assert d["exceeds"] is False and len(d["scores"]) == 200


@pytest.mark.slow
def test_positive_control_without_noise_exceeds_the_claim():
    res = _audit(broken="no-noise")
    assert res.mechanism["noise_multiplier"] == 0 and res.mechanism["claimed_noise_multiplier"] > 0.5
    assert res.claimed_epsilon == pytest.approx(2.0, abs=0.02)  # the intended σ's ε
    assert res.epsilon_lower_bound > res.claimed_epsilon and res.exceeds
    scores, member = torch.tensor(res.scores), torch.tensor(res.membership)
    assert scores[~member].abs().max() == 0  # noiseless: an out canary leaves no trace
    assert (scores[member] > 0).float().mean() > 0.95  # (in: >0 unless Poisson sampling never drew it)
    assert res.verdict.startswith("BOUND EXCEEDS CLAIM")


@pytest.mark.slow
def test_positive_control_unclipped_path_exceeds_the_claim():
    res = _audit(broken="unclipped")
    assert res.mechanism["noise_multiplier"] > 0.5  # the engine's part is noised...
    assert res.claimed_epsilon == pytest.approx(2.0, abs=0.02)  # ...and it reports ε = 2
    assert res.epsilon_lower_bound > res.claimed_epsilon and res.exceeds


@pytest.mark.slow
def test_general_path_and_cli(tmp_path, capsys):
    # the general path: the caller's dataset, model factory, canaries and score
    train, _, cx, cy, model_fn, score_fn = digits_canary_task(120, seed=3)
    with _seeded_noise_ok():
        res = dpzoo.audit(
            dataset=train,
            model_fn=model_fn,
            canaries=(cx, cy),
            score_fn=score_fn,
            epochs=3,
            broken="no-noise",
            seed=3,
            noise_seed=1,
            sample_seed=2,
        )
    assert res.canaries == 120 and res.test_accuracy is None and res.exceeds
    assert loss_score(model_fn(), cx, cy).shape == (120,)
    # the CLI: a positive control exits 1 and writes its JSON
    from dpzoo.cli import main

    assert main(["audit", "--canaries", "200", "--epochs", "4", "--broken", "no-noise", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "BOUND EXCEEDS CLAIM" in out and "claimed ε = 2" in out
    d = json.loads((tmp_path / "audit.json").read_text())
    assert d["broken"] == "no-noise" and d["exceeds"] is True and d["epsilon_lower_bound"] > d["claimed_epsilon"]


# -- the white-box audit (issue 27): every noisy step of the canaries' own coordinates ------------


def _dense_twin(sparse):
    """The dense linear model the sparse one stands for: weight columns 64 + i are its canary rows."""
    dense = torch.nn.Linear(sparse.pixels + sparse.canaries.num_embeddings, sparse.fc.out_features).double()
    with torch.no_grad():
        dense.weight.copy_(torch.cat([sparse.fc.weight, sparse.canaries.weight.T], 1))
        dense.bias.copy_(sparse.fc.bias)
    return dense


def _dirac(m, pixels, norm, rows):
    """Dense inputs of canaries ``rows`` (``canary_norm`` on coordinate pixels + i) and their sparse slots."""
    dense = torch.zeros(len(rows), pixels + m, dtype=torch.float64)
    dense[torch.arange(len(rows)), pixels + torch.tensor(rows)] = norm
    sparse = torch.zeros(len(rows), pixels + 1, dtype=torch.float64)
    sparse[:, pixels] = torch.tensor(rows, dtype=torch.float64) + 1
    return dense, sparse


def test_sparse_canary_model_is_the_dense_linear_model_with_the_same_per_sample_gradients():
    from dpzoo.audit import DiracCanaryClassifier

    torch.manual_seed(0)
    sparse = DiracCanaryClassifier(4, 6, canary_norm=7.0, num_classes=3).double()
    torch.nn.init.normal_(sparse.canaries.weight)
    dense = _dense_twin(sparse)
    xd, xs = _dirac(6, 4, 7.0, [0, 3, 5])
    pixels = torch.rand(2, 4, dtype=torch.float64)  # digits: no canary (slot 0)
    xd = torch.cat([torch.cat([pixels, torch.zeros(2, 6, dtype=torch.float64)], 1), xd])
    xs = torch.cat([torch.cat([pixels, torch.zeros(2, 1, dtype=torch.float64)], 1), xs])
    torch.testing.assert_close(sparse(xs), dense(xd))
    y = torch.tensor([0, 2, 1, 1, 0])
    for i in range(5):  # each sample's gradient, in the dense model's coordinates
        gs = torch.autograd.grad(torch.nn.functional.cross_entropy(sparse(xs[i : i + 1]), y[i : i + 1]),
                                 [sparse.fc.weight, sparse.canaries.weight, sparse.fc.bias])  # fmt: skip
        gd = torch.autograd.grad(torch.nn.functional.cross_entropy(dense(xd[i : i + 1]), y[i : i + 1]),
                                 [dense.weight, dense.bias])  # fmt: skip
        torch.testing.assert_close(torch.cat([gs[0], gs[1].T], 1), gd[0])
        torch.testing.assert_close(gs[2], gd[1])


@pytest.mark.parametrize("q", [0.1, 1.0])
def test_white_box_score_is_the_log_likelihood_ratio_of_the_claimed_mechanism(q):
    """One step, written by hand on the dense model: canary i's column of the noisy sum projected on
    its clipped gradient's direction z, and log(1 - q + q exp((a z - a²/2) / (σR)²)) with a its
    clipped length (q = 1: every canary in every step, no mixture)."""
    from dpzoo.audit import DiracCanaryClassifier
    from dpzoo.audit.white_box import CanaryColumnScores

    torch.manual_seed(0)
    sparse = DiracCanaryClassifier(4, 3, canary_norm=2.0, num_classes=5).double()
    torch.nn.init.normal_(sparse.canaries.weight)
    dense, (cx, _) = _dense_twin(sparse), _dirac(3, 4, 2.0, [0, 1, 2])
    cy = torch.tensor([1, 4, 0])
    sigma, R, scale = 1.3, 1.5, 8.0
    claim = {"noise_multiplier": sigma, "max_grad_norm": R, "sample_rate": q, "clipping": "abadi", "sum_scale": scale}
    scores = CanaryColumnScores(sparse, cy, claimed=claim)
    sparse.canaries.weight.grad = torch.randn_like(sparse.canaries.weight)
    scores.observe(None, (), {})
    expected, clipped = [], 0
    for i in range(3):
        residual = torch.softmax(dense(cx[i]), 0) - torch.nn.functional.one_hot(cy[i], 5).double()
        g = torch.cat([torch.outer(residual, cx[i]).flatten(), residual])  # the canary's whole gradient
        clipped_column = torch.outer(residual, cx[i])[:, 4 + i] * min(1.0, R / float(g.norm()))
        clipped += float(g.norm()) > R
        a = float(clipped_column.norm())
        z = float(sparse.canaries.weight.grad[i] * scale @ (clipped_column / a))
        log_in = math.log(q) + (a * z - a * a / 2) / (sigma * R) ** 2
        expected.append(log_in if q == 1 else math.log(1 - q + math.exp(log_in)))
    assert 0 < clipped < 3  # both branches of the clip
    assert torch.allclose(scores.scores, torch.tensor(expected, dtype=torch.float64), rtol=1e-9)


@pytest.mark.slow
def test_white_box_engine_stays_below_its_claim_and_the_controls_rank_above_it():
    engine = _audit(threat_model="white-box")
    doubled = _audit(threat_model="white-box", broken="sensitivity-2x")
    silent = _audit(threat_model="white-box", broken="no-noise")
    assert engine.mechanism["threat_model"].startswith("white-box") and not engine.exceeds
    assert doubled.claimed_epsilon == pytest.approx(engine.claimed_epsilon, rel=1e-3)
    assert doubled.mechanism["actual_max_grad_norm"] == 2 * doubled.mechanism["max_grad_norm"]
    assert doubled.epsilon_lower_bound > engine.epsilon_lower_bound  # a 2R leak is seen (not yet above ε = 2)
    assert silent.exceeds


def test_white_box_refuses_what_it_cannot_observe():
    with pytest.raises(dpzoo.DPZooError, match="threat_model must be"):
        dpzoo.audit(threat_model="grey-box")
    with pytest.raises(dpzoo.DPZooError, match="white-box.*built-in task"):
        dpzoo.audit(threat_model="white-box", dataset=[(torch.zeros(3), 0)], model_fn=lambda: None,
                    canaries=(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)))  # fmt: skip
    with pytest.raises(dpzoo.DPZooError, match="mode must be one of"):
        dpzoo.audit(mode="lora-all")
    for broken in ("group-outside-engine", "unclipped"):  # the mode would re-enable the frozen group
        with pytest.raises(dpzoo.DPZooError, match="drop mode='bitfit'"):
            dpzoo.audit(broken=broken, mode="bitfit", canaries=10, epochs=1)


def test_canaries_sit_anywhere_in_the_training_set():
    from dpzoo.audit import with_canaries

    train = torch.utils.data.TensorDataset(torch.zeros(50, 1), torch.zeros(50, dtype=torch.long))
    cx, cy = torch.ones(20, 1), torch.ones(20, dtype=torch.long)
    rows = with_canaries(train, cx, cy, torch.arange(20) % 2 == 0, seed=0)
    where = [i for i in range(len(rows)) if rows[i][1] == 1]
    assert len(rows) == 60 and len(where) == 10 and where != list(range(50, 60))


@pytest.mark.slow
@pytest.mark.parametrize("broken", ["noise-skipped-per-epoch", "group-outside-engine", "unclipped"])
def test_white_box_controls_of_a_skipped_noise_draw_and_of_training_outside_the_engine_exceed_the_claim(broken):
    """The realistic leaks the white-box audit must catch at its defaults: one noise draw per epoch
    left out (a noiseless release: the in-canaries drawn in it are seen exactly), and the canaries'
    parameter group trained by a plain optimizer (raw sums, observed where that optimizer steps)."""
    with _seeded_noise_ok():
        res = dpzoo.audit(epsilon=2.0, canaries=2500, epochs=5, threat_model="white-box", broken=broken,
                          seed=0, noise_seed=5, sample_seed=6)  # fmt: skip
    assert res.claimed_epsilon == pytest.approx(2.0, abs=0.02)  # what the engine reports
    assert res.exceeds and res.epsilon_lower_bound > res.claimed_epsilon + 1, res.lines()
    if broken == "noise-skipped-per-epoch":
        from dpzoo.audit.white_box import EXACT

        exact, member = torch.tensor(res.scores) > EXACT / 2, torch.tensor(res.membership)
        assert exact.sum() > 50 and not (exact & ~member).any()  # every exact release is an in-canary's


def _brute_gradient(model, x, y, params):
    g = torch.autograd.grad(torch.nn.functional.cross_entropy(model(x), y), params)
    return torch.cat([t.flatten() for t in g])


@pytest.mark.parametrize("mode", ["auto", "bitfit", "lora"])
def test_each_modes_canary_model_states_its_canaries_gradients_as_autograd_computes_them(mode):
    """What the white-box scorer clips under the claim, per canary: its gradient on its own
    coordinates (what the optimizer's .grad holds there after its backward alone) and the norm of
    its whole gradient over the mode's trainable parameters: against autograd, one canary at a
    time, at random weights, in float64; a digit reaches none of the canary coordinates."""
    from dpzoo.audit.canary_models import canary_model
    from dpzoo.privacy.modes import apply_mode

    torch.manual_seed(0)
    model = canary_model(mode, 4, 5, 3.0, 3).double()
    apply_mode(mode, model)
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        for p in params:
            p.normal_(0, 0.5)
    y = torch.tensor([0, 2, 1, 1, 0])
    x = torch.zeros(6, 5, dtype=torch.float64)
    x[:5, 4] = torch.arange(1, 6)
    x[5, :4] = torch.rand(4)  # a digit: slot 0
    own, full = model.canary_gradients(y)
    for i in range(6):
        model.zero_grad()
        label = y[i : i + 1] if i < 5 else torch.tensor([1])
        torch.nn.functional.cross_entropy(model(x[i : i + 1]), label).backward()
        release = model.canary_release()
        if i == 5:
            assert release.abs().max() == 0
            continue
        torch.testing.assert_close(release[i], own[i])
        assert release.norm(dim=1).count_nonzero() == 1  # no other canary's coordinates
        assert float(full[i]) == pytest.approx(float(_brute_gradient(model, x[i : i + 1], label, params).norm()))


def test_cli_audit_controls_are_the_audits():
    from dpzoo.audit import BROKEN
    from dpzoo.cli.choices import AUDIT_CONTROLS

    assert tuple(AUDIT_CONTROLS) == BROKEN


def test_cli_white_box_defaults_to_its_canary_count_and_reports_both_estimators(capsys):
    from dpzoo.audit import WHITE_BOX_CANARIES
    from dpzoo.cli import main

    with _seeded_noise_ok():
        assert main(["audit", "--white-box", "--epochs", "1", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert f"{WHITE_BOX_CANARIES} canaries" in out and WHITE_BOX_CANARIES > 1000
    assert "one-run (Steinke et al. 2023)" in out and "Gaussian DP (Nasr et al. 2023)" in out
    assert "each at 97.5%" in out
