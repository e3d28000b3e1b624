"""The white-box audit's Gaussian-DP estimator (Nasr et al. 2023): its pieces against independent
references (the binomial tail, dp-accounting's Gaussian mechanism), its coverage on scores whose
μ is known, and its place in the audit report."""

from __future__ import annotations

import math

import pytest
import torch
from dp_accounting.pld import privacy_loss_distribution
from scipy import stats

from dpzoo.audit.gdp import clopper_pearson_upper, gdp_epsilon, gdp_lower_bound


@pytest.mark.parametrize("k, n, alpha", [(0, 50, 0.05), (7, 40, 0.01), (399, 400, 0.025), (13, 1000, 1e-4)])
def test_clopper_pearson_upper_is_where_the_binomial_tail_equals_alpha(k, n, alpha):
    p = clopper_pearson_upper(k, n, alpha)
    assert stats.binom.cdf(k, n, p) == pytest.approx(alpha, rel=1e-6)
    assert clopper_pearson_upper(n, n, alpha) == 1.0


@pytest.mark.parametrize("mu", [0.3, 0.5, 1.0, 2.5])
def test_gdp_epsilon_matches_the_gaussian_mechanism_of_dp_accounting(mu):
    """μ-GDP is the Gaussian mechanism with sensitivity 1 and standard deviation 1/μ."""
    pld = privacy_loss_distribution.from_gaussian_mechanism(1 / mu, value_discretization_interval=1e-5)
    reference = pld.get_epsilon_for_delta(1e-5)
    assert gdp_epsilon(mu, 1e-5) == pytest.approx(reference, abs=2e-3)
    assert gdp_epsilon(0.0, 1e-5) == 0.0 and gdp_epsilon(-1.0, 1e-5) == 0.0


def _gaussian_scores(mu, m, seed):
    g = torch.Generator().manual_seed(seed)
    included = torch.rand(m, generator=g) < 0.5
    return torch.randn(m, generator=g, dtype=torch.float64) + mu * included, included


def test_gdp_bound_stays_below_the_true_mu_and_grows_with_it():
    """Scores of an exactly μ-GDP pair: the 95% bound never exceeds μ in 40 draws (a wrong
    confidence level would, about twice), and separates a larger μ from a smaller one."""
    for seed in range(40):
        scores, included = _gaussian_scores(0.5, 2000, seed)
        assert gdp_lower_bound(scores, included, 1e-5, 0.95)["mu"] <= 0.5
    small = gdp_lower_bound(*_gaussian_scores(0.5, 4000, 99), 1e-5, 0.95)
    large = gdp_lower_bound(*_gaussian_scores(2.0, 4000, 99), 1e-5, 0.95)
    assert 0 < small["mu"] < 0.5 and 1.5 < large["mu"] < 2.0
    assert large["epsilon_lower_bound"] == pytest.approx(gdp_epsilon(large["mu"], 1e-5))
    assert large["epsilon_lower_bound"] < large["max_auditable_epsilon"]


def test_gdp_bound_is_zero_when_scores_carry_no_membership():
    scores, included = _gaussian_scores(0.0, 1000, 3)
    result = gdp_lower_bound(scores, included, 1e-5, 0.95)
    assert result["epsilon_lower_bound"] == 0.0 or result["mu"] < 0.2
    tied = gdp_lower_bound(torch.zeros(100), torch.arange(100) % 2 == 0, 1e-5, 0.95)
    assert tied["epsilon_lower_bound"] == 0.0


def test_white_box_report_names_both_estimators_at_half_the_error_budget():
    import dpzoo

    result = dpzoo.audit(epsilon=2.0, canaries=200, epochs=2, threat_model="white-box", seed=0)
    assert set(result.estimators) == {"one-run", "gdp"}
    assert all(e["confidence"] == pytest.approx(0.975) for e in result.estimators.values())
    assert result.epsilon_lower_bound == max(e["epsilon_lower_bound"] for e in result.estimators.values())
    assert result.estimators[result.estimator]["epsilon_lower_bound"] == result.epsilon_lower_bound
    assert any("Gaussian DP (Nasr et al. 2023)" in line for line in result.lines())
    black = dpzoo.audit(epsilon=2.0, canaries=200, epochs=2, seed=0)
    assert set(black.estimators) == {"one-run"} and black.estimators["one-run"]["confidence"] == 0.95
    assert not math.isnan(black.epsilon_lower_bound)
