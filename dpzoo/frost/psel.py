"""PSEL (DP-FROST Algorithm 4) and the noise-free measurements it noises.

:class:`PartitionGradientMeasure` gives the clipped partition-wise gradient magnitudes (PGMs,
:mod:`.magnitudes`) of chosen partitions on chosen examples, from dpzoo's per-sample hooks;
:func:`psel` adds the Gaussian noise of each iteration, estimates ν with PGM-EST
(:mod:`.estimation`) and selects. :func:`default_loss` is the selection's default loss.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Subset

from ..grad_norms import attach_norm_hooks
from . import magnitudes as MG
from .estimation import pgm_est, pgm_variance
from .partitions import Partition

__all__ = ["PartitionGradientMeasure", "psel", "default_loss"]


def default_loss(model: nn.Module, batch) -> torch.Tensor:
    """Summed cross-entropy for (inputs…, labels) tuples or dicts with "labels"; HF outputs OK."""
    if isinstance(batch, dict):
        labels = batch["labels"]
        out = model(**{k: v for k, v in batch.items() if k != "labels"})
    else:
        *inputs, labels = batch
        out = model(*inputs)
    logits = getattr(out, "logits", out)
    return F.cross_entropy(logits, labels, reduction="sum")


def _batch_len(batch) -> int:
    if isinstance(batch, dict):
        return len(next(iter(batch.values())))
    return len(batch[0])


class PartitionGradientMeasure:
    """Noise-free PGMs of chosen partitions on a set of examples, from dpzoo's per-sample hooks."""

    def __init__(self, model, dataset, collate_fn, loss_fn, method, alpha, clip, physical):
        self.model, self.dataset, self.collate_fn, self.loss_fn = model, dataset, collate_fn, loss_fn
        self.method, self.alpha, self.clip, self.physical = method, alpha, clip, physical
        self.samples = 0

    def __call__(self, parts: list[Partition], indices: list[int]) -> torch.Tensor:
        sizes = [p.size for p in parts]
        wanted = {n for p in parts for n in p.params}
        params = dict(self.model.named_parameters())
        flags = {n: p.requires_grad for n, p in params.items()}
        was_training = self.model.training
        sums = None
        try:
            for n, p in params.items():  # Lemma 1: clip over the measured partitions only
                p.requires_grad_(n in wanted)
            self.model.eval()
            hooks = attach_norm_hooks(self.model, mode="instantiate", ghost_backward=True)
            try:
                if indices:
                    loader = DataLoader(
                        Subset(self.dataset, indices), batch_size=self.physical, collate_fn=self.collate_fn
                    )
                    for batch in loader:
                        hooks.backward(self.loss_fn(self.model, batch))
                        grads = MG.partition_grads(hooks.per_sample_grads(row_sparse=True), parts)
                        part = MG.clipped_partition_sums(grads, self.method, self.alpha, self.clip, sizes)
                        sums = part if sums is None else [a + b for a, b in zip(sums, part)]
                        self.samples += _batch_len(batch)
                        hooks.clear()
            finally:
                hooks.detach()
        finally:
            for n, p in params.items():
                p.requires_grad_(flags[n])
                p.grad = None
            self.model.train(was_training)
        if sums is None:  # an empty Poisson sample: every PGM is 0, only noise is released
            return torch.zeros(len(parts), dtype=torch.float64)
        return MG.pgms(sums, self.method, self.alpha, sizes).double()


def psel(
    measure,
    partitions: list[Partition],
    num_examples: int,
    noise_multiplier: float,
    sample_rate: float,
    iterations: int,
    ratio: float,
    gap: float,
    method: str,
    alpha: int,
    clip: float,
    generator: torch.Generator,
    pgm_iterations: int = 1000,
    on_iteration: Callable[[int], None] | None = None,
):
    """PSEL (Algorithm 4). ``measure(parts, indices)`` returns noise-free PGMs of ``parts`` on
    the examples ``indices``; ``on_iteration(t)`` is called after each of the ``iterations``
    noisy releases (every one of them, the noise-only ones too). Returns (selected partitions,
    ν estimates, per-iteration log)."""
    m = len(partitions)
    total = sum(p.size for p in partitions)
    index = {p.name: i for i, p in enumerate(partitions)}
    remaining = list(partitions)
    selected: list[Partition] = []
    obs = torch.zeros(iterations, m, dtype=torch.float64)
    mask = torch.zeros(iterations, m, dtype=torch.bool)
    noise_std = torch.zeros(iterations, dtype=torch.float64)
    nu = torch.zeros(m, dtype=torch.float64)
    log = []
    for t in range(1, iterations + 1):
        if not remaining:
            # nothing left to measure; the step is still run and accounted (noise only)
            log.append({"iteration": t, "sample": 0, "selected": []})
            if on_iteration is not None:
                on_iteration(t)
            continue
        chosen = (torch.rand(num_examples, generator=generator) < sample_rate).nonzero().flatten().tolist()
        sizes = [p.size for p in remaining]
        delta_t = MG.sensitivity(method, alpha, clip, sizes)
        clean = measure(remaining, chosen)
        noisy = clean + noise_multiplier * delta_t * torch.randn(
            len(remaining), generator=generator, dtype=torch.float64
        )
        cols = [index[p.name] for p in remaining]
        obs[t - 1, cols], mask[t - 1, cols] = noisy, True
        noise_std[t - 1] = noise_multiplier * delta_t
        nu, lam = pgm_est(obs[:t], mask[:t], sample_rate, noise_std[:t], iterations=pgm_iterations)
        var = pgm_variance(lam, mask[:t], noise_std[:t])
        # threshold: ν of the partition where the smallest reach (1 - γ)|Θ| (lines 11-18)
        order = sorted(remaining, key=lambda p: float(nu[index[p.name]]))
        acc, thres = 0, float(nu[index[order[-1].name]])
        for p in order:
            acc += p.size
            if acc >= (1 - ratio) * total:
                thres = float(nu[index[p.name]])
                break
        budget = t * ratio * total / iterations * (1 + 1e-9)  # γ|Θ| in floating point (0.3·360 < 108)
        used = sum(p.size for p in selected)
        new = []
        for p in reversed(order):  # largest ν first (lines 19-23)
            if used + p.size > budget:
                continue  # does not fit: try the next largest (see the module docstring)
            i = index[p.name]
            if t == iterations or float(nu[i]) > thres + gap * math.sqrt(float(var[i])):
                new.append(p)
                used += p.size
        selected += new
        remaining = [p for p in remaining if p not in new]
        log.append(
            {
                "iteration": t,
                "sample": len(chosen),
                "sensitivity": delta_t,
                "threshold": thres,
                "selected": [p.name for p in new],
            }
        )
        if on_iteration is not None:
            on_iteration(t)
    return selected, {p.name: float(nu[index[p.name]]) for p in partitions}, log
