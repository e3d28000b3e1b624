"""The floating-point guard on ghost norms: a norm the book-kept sum can trust.

A ghost norm ‖g‖² = Σ_{t,s}⟨L_t,L_s⟩⟨R_t,R_s⟩ is formed from Gram matrices, while the clipped sum
adds the gradient itself (one GEMM over the B·T rows). Where the two disagree in floating point
the clip factor does not bound what is added. Found by the audits:

* cancellation: positions whose gradients cancel (x₁ = x₂, δ₂ = −(1−ε)δ₁) make the Gram sum a
  small difference of terms ~U², U = Σ_t ‖L_t‖‖R_t‖ ≥ ‖g‖; in float32 it read 0 (326 R);
* underflow: activations of 1e-23 square to 0 in float32 while the products the sum forms
  (1e-23 · 1e17) do not: norm 0, the sample released unclipped (784 R).

:func:`guard` takes a parameter's ghost-path squared norms and (1) computes U in float64 (no
under- or overflow for float32 values), (2) recomputes in float64 every sample whose norm is
below (GHOST_FLOOR · U)², the only samples where either failure can hide, and (3) floors the
result at (GHOST_FLOOR · U)², so a gradient that cancels below it is clipped as if its norm were
the floor (the sum's own rounding then stays a small fraction of R). Ordinary data never comes
near the floor: ‖g‖ ≈ U/√T, 0.016·U at T = 4096. Not a proof: float32 rounding of Gram entries
over very wide layers (d ≳ 4096) with crafted cancellation above the floor can still exceed R by
a few percent or more (docs/DESIGN.md, "Floating point").
"""

from __future__ import annotations

import torch

from . import reps as R

__all__ = ["GHOST_FLOOR", "triangle_bound", "guard"]

GHOST_FLOOR = 2.0**-8
RECHECK = 2.0**-6  # below RECHECK · U a float32 ghost norm is recomputed in float64


def _norm64(t: torch.Tensor) -> torch.Tensor:
    """‖t‖ over the last dim in float64, free of float32 under- and overflow: rows whose float32
    norm is near the limits of squaring (or 0, inf, NaN) are scaled by their largest entry first."""
    n = torch.linalg.vector_norm(t, dim=-1)
    risky = ~((n > 2.0**-60) & (n < 2.0**60))
    n = n.double()
    if risky.any():
        rows = t[risky]
        top = rows.abs().amax(-1, keepdim=True)
        top = torch.where(top > 0, top, torch.ones_like(top))
        n[risky] = torch.linalg.vector_norm(rows / top, dim=-1).double() * top.squeeze(-1).double()
    return n


def triangle_bound(rep: "R.Rep") -> torch.Tensor:
    """U_i = Σ_t ‖L_t‖‖R_t‖ ≥ ‖g_i‖ in float64 (one-hot rows have norm 1), free of cancellation."""
    if isinstance(rep, R.Dense):
        return _norm64(rep.grad.flatten(1))
    right = _norm64(rep.right)
    if isinstance(rep, R.OneHot):
        return right.sum(1)
    return (_norm64(rep.left) * right).flatten(1).sum(1)


def _rows64(rep: "R.Rep", rows: torch.Tensor) -> "R.Rep":
    """The samples ``rows`` of ``rep``, in float64."""
    if isinstance(rep, R.Dense):
        return R.Dense(rep.grad[rows].double())
    if isinstance(rep, R.Factored):
        return R.Factored(rep.left[rows].double(), rep.right[rows].double(), rep.shape)
    return R.OneHot(rep.index[rows], rep.right[rows].double(), rep.num_rows)


def _sq_norm64(reps: list, rows: torch.Tensor) -> torch.Tensor:
    rs = [_rows64(r, rows) for r in reps]
    total = sum(R.sq_norm(r, ghost=True) for r in rs)
    for i in range(len(rs)):
        for j in range(i + 1, len(rs)):
            total = total + 2 * R.inner(rs[i], rs[j], ghost=True)
    return total.clamp_min(0)


def guard(reps: list, total: torch.Tensor) -> torch.Tensor:
    """``total`` (a parameter's per-sample squared norms from ``reps``, some on the ghost path),
    suspicious samples recomputed in float64, floored at (GHOST_FLOOR · U)²; in ``total``'s dtype."""
    bound = sum(triangle_bound(r) for r in reps)
    floor = (GHOST_FLOOR * bound).square()
    out = total.double()
    low = out < (RECHECK * bound).square() if total.dtype != torch.float64 else out < floor
    if low.any():
        rows = low.nonzero().squeeze(1)
        out = out.index_copy(0, rows, _sq_norm64(reps, rows))
    return torch.maximum(out, floor).to(total.dtype)
