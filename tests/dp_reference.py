"""Brute-force references for the DP-SGD step, sharing no code with what they check.

Per-sample gradients come from single-sample backward passes (:func:`grad_reference.per_sample_grads`);
the clip weight is written here in closed form from the papers, not taken from dpzoo:

- Abadi et al. 2016 (DP-SGD, Algorithm 1): ``g_i · min(1, R / ‖g_i‖)``;
- Bu et al. 2023 (automatic clipping, AUTO-S, eq. 4.1): ``g_i · R / (‖g_i‖ + γ)``, γ = 0.01.

Noise is N(0, σ²R²) per coordinate, drawn from a generator seeded ``seed`` as dpzoo draws seeded
noise (:func:`seeded_noise`: one draw per dtype of all its trainable parameters' coordinates, in
``named_parameters`` order), so a seeded step can be compared exactly.
``tests/test_source_layout.py`` checks that this module imports nothing of dpzoo's clipping, noise
or accounting code.
"""

from __future__ import annotations

import torch
from grad_reference import per_sample_grads

AUTO_S_GAMMA = 0.01  # Bu et al. 2023, AUTO-S: the stability constant of automatic clipping


def seeded_noise(params: list, std: float, gen: torch.Generator) -> list[torch.Tensor]:
    """N(0, std²) for each of ``params`` (tensors, or (shape, dtype) pairs) in the order dpzoo's
    optimizer draws it: per dtype, in order of first appearance, one draw of all those parameters'
    coordinates in order, in float32 for half-precision parameters (the mechanism's dtype)."""
    shapes = [(tuple(p.shape), p.dtype) if isinstance(p, torch.Tensor) else (tuple(p[0]), p[1]) for p in params]
    groups: dict = {}
    for i, (_, dtype) in enumerate(shapes):
        groups.setdefault(dtype, []).append(i)
    out: list = [None] * len(shapes)
    for dtype, idx in groups.items():
        draw = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        sizes = [torch.Size(shapes[i][0]).numel() for i in idx]
        flat = torch.normal(0.0, std, size=(sum(sizes),), generator=gen, dtype=draw)
        for i, part in zip(idx, flat.split(sizes)):
            out[i] = part.view(shapes[i][0])
    return out


def clip_weights(norms: torch.Tensor, R: float, clipping: str = "abadi") -> torch.Tensor:
    """The per-sample weight C_i of the clipped sum Σ C_i g_i, in closed form."""
    if clipping == "abadi":
        return torch.where(norms > R, R / norms, torch.ones_like(norms))
    if clipping == "automatic":
        return R / (norms + AUTO_S_GAMMA)
    raise ValueError(clipping)


def total_norms(grads: list[dict], names: list[str]) -> torch.Tensor:
    """‖g_i‖ over every trainable parameter, per sample."""
    return torch.stack([torch.sqrt(sum(g[n].pow(2).sum() for n in names)) for g in grads])


def dp_sgd_update(
    model,
    loss_i,
    inputs: dict,
    batch: int,
    R: float,
    sigma: float,
    seed: int | None,
    clipping: str = "abadi",
    expected: float | None = None,
    lr: float = 1.0,
    names: list[str] | None = None,
) -> dict[str, torch.Tensor]:
    """The SGD update -lr · (Σ_i C_i g_i + N(0, σ²R²)) [/ expected batch size], per trainable
    parameter; no noise when ``seed`` is None and σ = 0."""
    grads = per_sample_grads(model, loss_i, inputs, batch)
    params = dict(model.named_parameters())
    names = names if names is not None else [n for n, p in params.items() if p.requires_grad]
    c = clip_weights(total_norms(grads, names), R, clipping)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    noise = seeded_noise([params[n] for n in names], sigma * R, gen) if sigma else [0.0] * len(names)
    out = {}
    for n, z in zip(names, noise):
        g = sum(c[i] * grads[i][n] for i in range(batch)) + z
        out[n] = -lr * (g / expected if expected else g)
    return out
