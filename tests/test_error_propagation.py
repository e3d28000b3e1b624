"""Re-Attention's error propagation against Monte-Carlo sampling (within 5%, cf. DPFormer
Table 3), and the attention correction on a hand-computed case."""

import math

import pytest
import torch
import torch.nn.functional as F

from dpzoo.seqrec import error_propagation as ep

N = 400_000


def _mc(fn, c, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = c + d.sqrt() * torch.randn(N, *c.shape, generator=g, dtype=torch.float64)
    y = fn(x)
    return y.mean(0), y.var(0)


CD = [(-1.0, 0.5), (0.0, 1.0), (0.7, 0.3), (2.0, 1.5), (-0.2, 0.05)]


@pytest.mark.parametrize("c, d", CD)
def test_relu_matches_monte_carlo(c, d):
    c, d = torch.tensor([c], dtype=torch.float64), torch.tensor([d], dtype=torch.float64)
    m, v = ep.relu(c, d)
    mm, mv = _mc(torch.relu, c, d)
    assert torch.allclose(m, mm, rtol=0.05, atol=1e-3) and torch.allclose(v, mv, rtol=0.05)


def test_printed_eq_5_6_misses_monte_carlo():
    """Eq. 5.6 as printed subtracts c² instead of E[ReLU(X)]²: off by far more than 5%."""
    c, d = torch.tensor([0.7], dtype=torch.float64), torch.tensor([0.3], dtype=torch.float64)
    _, mv = _mc(torch.relu, c, d)
    printed = ep.paper_eq_5_6(c, d)
    assert (printed - mv).abs() / mv > 0.05
    assert (ep.relu(c, d)[1] - mv).abs() / mv < 0.05


@pytest.mark.parametrize("c, d", CD)
def test_gelu_matches_monte_carlo(c, d):
    c, d = torch.tensor([c], dtype=torch.float64), torch.tensor([d], dtype=torch.float64)
    m, v = ep.gelu(c, d)
    mm, mv = _mc(F.gelu, c, d)
    assert torch.allclose(m, mm, rtol=0.05, atol=1e-3) and torch.allclose(v, mv, rtol=0.05)


def test_linear_matches_monte_carlo_with_weight_noise():
    g = torch.Generator().manual_seed(1)
    d_in, d_out, var_w = 6, 4, 0.01
    mean = torch.randn(d_in, generator=g, dtype=torch.float64)
    var = torch.rand(d_in, generator=g, dtype=torch.float64) * 0.5
    w = torch.randn(d_out, d_in, generator=g, dtype=torch.float64) * 0.5
    b = torch.randn(d_out, generator=g, dtype=torch.float64)
    m, v = ep.linear(mean, var, w, b, var_w=var_w)
    x = mean + var.sqrt() * torch.randn(N // 4, d_in, generator=g, dtype=torch.float64)
    wn = w + math.sqrt(var_w) * torch.randn(N // 4, d_out, d_in, generator=g, dtype=torch.float64)
    y = torch.einsum("noi,ni->no", wn, x) + b
    assert torch.allclose(m, y.mean(0), rtol=0.05, atol=0.02)
    assert torch.allclose(v, y.var(0), rtol=0.05)


def test_reattention_hand_computed():
    scores = torch.tensor([[[0.5, 0.3, 0.2]]], dtype=torch.float64)
    q = torch.tensor([[[1.0, 1.0]]], dtype=torch.float64)  # C = 2
    key_var = torch.tensor([[0.0, math.log(2.0), 0.0]], dtype=torch.float64)  # key 1 gets / exp(ln 2) = / 2
    out = ep.reattention(scores, key_var, q)
    expected = torch.tensor([0.5, 0.15, 0.2], dtype=torch.float64) / 0.85
    assert torch.allclose(out[0, 0], expected)
    assert torch.allclose(ep.reattention(scores, torch.zeros(1, 3, dtype=torch.float64), q), scores)
