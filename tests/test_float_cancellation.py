"""Ghost norms the book-kept sum can trust (grad_norms/float_guard.py).

The ghost norm ‖g‖² = Σ_{t,s}⟨x_t,x_s⟩⟨δ_t,δ_s⟩ of a sample with x_1 = x_2 = x and δ_2 = -(1-ε)δ_1
(so g = ε x⊗δ) is a small difference of terms ~‖x‖²‖δ‖²; in float32 it read 0 for small ε and the
sample was released unclipped (326 R in the audit), while the book-kept sum carried its gradient.
Float32 underflow did the same (activations 1e-23: Grams 0, the sum's products not). Suspicious
norms are now recomputed in float64 and floored at GHOST_FLOOR · Σ_t ‖x_t‖‖δ_t‖, so the released
contribution stays ≤ R up to the sum's rounding; ordinary data never reaches the floor.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpzoo
from dpzoo.grad_norms import float_guard
from dpzoo.grad_norms import reps as R
from dpzoo.grad_norms.param_grad import ParamGrad

D = 64


def released_contribution(
    mode: str, eps: float, r: float = 1.0, x_norm: float = 1000.0, d_norm: float = 1000.0, dtype=torch.float32
) -> float:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    xv = torch.randn(D, generator=g, dtype=torch.float64)
    dv = torch.randn(D, generator=g, dtype=torch.float64)
    xv, dv = (xv / xv.norm() * x_norm).to(dtype), (dv / dv.norm() * d_norm).to(dtype)
    model = nn.Linear(D, D, bias=False).to(dtype)
    engine = dpzoo.PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(
            TensorDataset(torch.zeros(32, 2, D, dtype=dtype), torch.zeros(32, 2, D, dtype=dtype)), batch_size=8
        ),
        noise_multiplier=0.0,
        max_grad_norm=r,
        loss_reduction="sum",
        mode=mode,
        sample_seed=1,
        self_check=False,
    )
    x, y = next(b for b in loader if len(b[0]))
    first = torch.zeros(len(x), 1, 1, dtype=dtype)
    first[0] = 1  # sample 0 alone; built from the batch's rows (a write into them by position is refused)
    x, y = x * 0 + first * xv, y * 0 + first * torch.stack([dv, -(1 - eps) * dv])
    (model(x) * y).sum().backward()
    opt.step()
    return model.weight.grad.norm().item() / r  # sample 0 alone has a gradient: its contribution, in R


@pytest.mark.parametrize("mode", ["bk", "bk-mixopt", "instantiate"])
@pytest.mark.parametrize("eps", [1e-5, 1e-4, 5e-4, 2e-3, 1e-2])
def test_a_cancelling_sample_is_clipped(mode, eps):
    assert released_contribution(mode, eps) <= 1.005


@pytest.mark.parametrize("mode", ["bk", "bk-mixopt"])
def test_a_sample_whose_grams_underflow_is_clipped(mode):
    """Activations of norm 1e-21 (entries ~1e-22: their squares underflow float32) and output
    gradients of norm 1e19 (ε = 1: only position 1 counts): ‖g‖ = 1e-2 = 10 R, while the float32
    Grams read 0."""
    assert released_contribution(mode, 1.0, r=1e-3, x_norm=1e-21, d_norm=1e19) <= 1.005


@pytest.mark.parametrize("eps", [1e-9, 1e-7])
def test_float64_ghost_norms_are_guarded_too(eps):
    assert released_contribution("bk", eps, x_norm=1e5, d_norm=1e5, dtype=torch.float64) <= 1.005


def test_ordinary_gradients_never_reach_the_floor():
    """Random activations and output gradients over T positions: ‖g‖ ~ U/√T, far above the floor,
        so the floor is never what clips: the guarded norm is the ghost norm plus its rounding bound, above
    the exact norm and within LOOSE of the computed one."""
    g = torch.Generator().manual_seed(0)
    for t in (1, 16, 512):
        rep = R.Factored(torch.randn(6, 1, t, 48, generator=g), torch.randn(6, 1, t, 40, generator=g), (48, 40))
        ghost = R.sq_norm(rep, ghost=True)
        assert (ghost.sqrt() > 4 * float_guard.GHOST_FLOOR * float_guard.triangle_bound(rep)).all()
        guarded = ParamGrad([rep], ghost=True).sq_norm()  # the ghost norm plus its rounding bound
        exact = R.sq_norm(R.Factored(rep.left.double(), rep.right.double(), rep.shape), ghost=False)
        assert (guarded.double() >= exact).all()
        assert (guarded <= ghost * (1 + float_guard.LOOSE)).all()


def test_triangle_bound_bounds_every_representation():
    g = torch.Generator().manual_seed(2)
    reps = [
        R.Dense(torch.randn(5, 7, 3, generator=g)),
        R.Factored(torch.randn(5, 2, 9, 4, generator=g), torch.randn(5, 2, 9, 3, generator=g), (2, 4, 3)),
        R.OneHot(torch.randint(0, 6, (5, 9), generator=g), torch.randn(5, 9, 3, generator=g), 6),
    ]
    for rep in reps:
        true = torch.linalg.vector_norm(R.instantiate(rep).flatten(1), dim=1)
        assert (float_guard.triangle_bound(rep) >= true * (1 - 1e-6)).all()
