"""The mechanism under audit: one private training run by dpzoo's engine, or a broken variant.

Training is the engine's public API (Poisson batches, SGD, ``target_epsilon`` at δ, clipping at
``max_grad_norm``): step 2 of the one-run audit (Steinke, Nasr & Jagielski 2023, Algorithm 1).

**Positive controls** (``broken=``, one of :data:`BROKEN`), built here, never by the engine:

* ``"no-noise"``: the engine runs with ``noise_multiplier=0`` while the claimed ε is the one of
  the σ the engine would have calibrated for the target ε (dp-accounting, the same steps);
* ``"unclipped"``: a second copy of the model, added to the first one's output, is trained
  by a plain torch SGD optimizer outside the engine: DP-SGD's update with the engine's noise
  (same σ, R, expected batch size) but without clipping; the claimed ε is the engine's report.
  Large-norm canaries (``canary_norm``) make that unclipped gradient dwarf the noise.

Both must end with a bound above the claim; dpzoo's engine must not (with probability ≥ 1 - β).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..progress import StepBar

__all__ = ["BROKEN", "train_audited_model"]

BROKEN = ("no-noise", "unclipped")


class _OutsideEngine(nn.Module):
    """The "unclipped" bug: ``side``'s output is added to the engine's model, and ``side`` is
    trained by a plain optimizer on raw gradients (no clipping, no noise)."""

    def __init__(self, private: nn.Module, side: nn.Module):
        super().__init__()
        self.private, self.side = private, side

    def forward(self, x):
        return self.private(x) + self.side(x)


def train_audited_model(
    train_set,
    model_fn,
    loss_fn,
    *,
    epsilon,
    delta,
    epochs,
    batch_size,
    lr,
    max_grad_norm,
    clipping,
    broken,
    accountant,
    noise_seed,
    sample_seed,
    log,
    progress=None,
):
    """One private training run with dpzoo's engine (or a deliberately broken variant).

    Returns (released model, claimed ε at δ, mechanism settings)."""
    from ..privacy import Accountant, PrivacyEngine, get_noise_multiplier

    model = model_fn().train()
    side = side_opt = None
    if broken == "unclipped":
        side = model_fn().train()
        side_opt = torch.optim.SGD(side.parameters(), lr=lr)  # outside the engine: noised but unclipped
    engine = PrivacyEngine(accountant=accountant)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    noise = dict(noise_multiplier=0.0) if broken == "no-noise" else dict(target_epsilon=epsilon)
    seeds = {k: v for k, v in (("noise_seed", noise_seed), ("sample_seed", sample_seed)) if v is not None}
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(train_set, batch_size=batch_size),
        target_delta=delta,
        epochs=epochs,
        max_grad_norm=max_grad_norm,
        clipping=clipping,
        mode="auto",
        **noise,
        **seeds,
    )
    q = batch_size / len(train_set)
    intended = (
        get_noise_multiplier(epsilon, delta, q, epochs * len(loader), accountant)
        if broken == "no-noise"
        else engine.noise_multiplier
    )
    released = _OutsideEngine(model, side) if side is not None else model
    log(
        f"training: {len(train_set)} examples, q = {q:.4f}, σ = {engine.noise_multiplier:.3f}"
        f"{f' (claimed: {intended:.3f})' if broken == 'no-noise' else ''}, {epochs} epochs"
        f"{', plus a copy trained outside the engine' if side is not None else ''}"
    )
    steps = 0
    desc = f"audit ({broken})" if broken else "audit"
    with StepBar(epochs * len(loader), desc, enabled=progress, epsilon=lambda: engine.get_epsilon(delta)) as bar:
        for _ in range(epochs):
            for x, y in loader:
                loss = None
                if len(y):  # an empty Poisson batch: no backward, the optimizer still adds noise and counts the step
                    loss = loss_fn(released(x), y)
                    loss.backward()
                opt.step()
                opt.zero_grad()
                if side_opt is not None:
                    _noisy_unclipped_step(side, side_opt, len(y), engine.noise_multiplier * max_grad_norm, batch_size)
                steps += 1
                bar.step(None if loss is None else loss.detach())
    engine.detach()
    steps = int(getattr(engine, "steps", steps))  # the accountant's count (it includes any step the engine took itself)
    if broken == "no-noise":
        acc = Accountant(accountant)
        acc.step(intended, q, steps)
        claimed = acc.get_epsilon(delta)
    else:
        claimed = engine.get_epsilon(delta)
    mech = {
        "noise_multiplier": float(engine.noise_multiplier),
        "claimed_noise_multiplier": float(intended),
        "max_grad_norm": max_grad_norm,
        "clipping": clipping,
        "sample_rate": q,
        "steps": steps,
        "epochs": epochs,
        "batch_size": batch_size,
        "lr": lr,
        "accountant": accountant,
        "optimizer": "SGD",
        "outside_engine": (
            "a model copy trained by plain SGD on noised, unclipped gradients" if side is not None else None
        ),
    }
    return released, claimed, mech


def _noisy_unclipped_step(
    side: nn.Module, opt: torch.optim.Optimizer, batch: int, std: float, expected_batch: float
) -> None:
    """The "unclipped" bug: DP-SGD's update without the clipping. The sum of the raw per-sample
    gradients (``batch`` times the mean-loss gradient) plus the engine's noise N(0, σ²R²),
    divided by the expected batch size as the engine does, then a plain optimizer step."""
    with torch.no_grad():
        for p in side.parameters():
            total = p.grad * batch if p.grad is not None else torch.zeros_like(p)
            p.grad = (total + std * torch.randn_like(p)) / expected_batch
    opt.step()
    opt.zero_grad()
