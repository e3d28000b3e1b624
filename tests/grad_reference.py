"""Brute-force references for per-sample gradients: a loop of per-sample backward passes."""

from __future__ import annotations

import torch
from torch import nn


def per_sample_grads(model: nn.Module, loss_fn, inputs: dict, batch_size: int) -> list[dict[str, torch.Tensor]]:
    """[{param name: ∂L_i/∂θ}] for i in range(B), by B separate backward passes.

    ``inputs`` maps argument names to batch-first tensors; ``loss_fn(model, **inputs_i)``
    returns sample i's loss. Names are those of ``model.named_parameters()`` (tied
    tensors once, under their first name).
    """
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    out = []
    for i in range(batch_size):
        for p in params.values():
            p.grad = None
        sample = {k: v[i : i + 1] for k, v in inputs.items()}
        loss_fn(model, **sample).backward()
        out.append(
            {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for n, p in params.items()}
        )
    for p in params.values():
        p.grad = None
    return out


def reference(model, loss_fn, inputs, batch_size, scale):
    grads = per_sample_grads(model, loss_fn, inputs, batch_size)
    names = list(grads[0])
    per_param = {n: torch.stack([g[n].flatten().norm() for g in grads]) for n in names}
    total = torch.stack([torch.sqrt(sum(g[n].pow(2).sum() for n in names)) for g in grads])
    clipped = {n: sum(scale[i] * grads[i][n] for i in range(batch_size)) for n in names}
    return total, per_param, clipped


def assert_close(actual, expected, rtol, what="", floor=1e-12):
    """max |actual - expected| <= rtol · max(max |expected|, floor).

    ``floor``: the scale below which differences do not matter, e.g. the total per-sample norm
    when comparing one parameter's norm whose true value is 0 (only rounding noise)."""
    actual, expected = actual.detach().to(torch.float64), expected.detach().to(torch.float64)
    scale = expected.abs().max().clamp_min(float(floor))
    err = (actual - expected).abs().max() / scale
    assert err <= rtol, f"{what}: relative error {err:.3e} > {rtol:.0e}"
