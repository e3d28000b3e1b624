"""The mechanism under audit: one private training run by dpzoo's engine, or a broken variant.

Training is the engine's public API (Poisson batches, SGD, ``target_epsilon`` at δ, clipping at
``max_grad_norm``): step 2 of the one-run audit (Steinke, Nasr & Jagielski 2023, Algorithm 1).

**Positive controls** (``broken=``, one of :data:`BROKEN`), built here, never by the engine:

* ``"no-noise"``: the engine runs with ``noise_multiplier=0`` while the claimed ε is the one of
  the σ the engine would have calibrated for the target ε (dp-accounting, the same steps);
* ``"unclipped"``: a second copy of the model, added to the first one's output, is trained
  by a plain torch SGD optimizer outside the engine: DP-SGD's update with the engine's noise
  (same σ, R, expected batch size) but without clipping; the claimed ε is the engine's report.
  Large-norm canaries (``canary_norm``) make that unclipped gradient dwarf the noise;
* ``"sensitivity-1.5x"`` / ``"sensitivity-2x"``: the engine clips at k·R with σ/k, so the noise
  is the claimed σR but one sample moves the sum by k·R (a clipping bug; true ε ≈ k²·ε at small ε);
* ``"half-noise"``: the engine runs with σ/2 while claiming σ;
* ``"noise-skipped-per-epoch"``: the engine's noise draw of each epoch's first step is left out
  (a restart or resume bug); the claimed ε is the engine's report;
* ``"group-outside-engine"``: the canaries' own coordinates form a parameter group the engine
  does not cover, trained by a plain optimizer on their raw summed gradients (no clipping, no
  noise); the claimed ε is the engine's report for the rest.

Every control must end with a bound above the claim (the white-box audit at its defaults; the
black-box one sees the extreme ones only); dpzoo's engine must not (with probability ≥ 1 - β).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..errors import WeakPrivacyWarning
from ..grad_norms.sample_rows import plain
from ..runs.progress import StepBar

__all__ = ["BROKEN", "train_audited_model"]

BROKEN = (
    "no-noise",
    "unclipped",
    "sensitivity-1.5x",
    "sensitivity-2x",
    "half-noise",
    "noise-skipped-per-epoch",
    "group-outside-engine",
)
SCALED = {"sensitivity-1.5x": 1.5, "sensitivity-2x": 2.0}  # a clip that lets k·R of a sample through
RECALIBRATED = ("no-noise", "half-noise", *SCALED)  # the engine runs another σ or R than the claim's


class _OutsideEngine(nn.Module):
    """The "unclipped" and "group-outside-engine" bugs: ``side``'s output is added to the engine's
    model, and ``side`` is trained by a plain optimizer outside the engine. ``canaries_only``:
    only side's canary part counts (its output at the input less its output with the canary slot
    emptied), the coordinates the private model leaves to it."""

    def __init__(self, private: nn.Module, side: nn.Module, canaries_only: bool = False):
        super().__init__()
        self.private, self.side, self.canaries_only = private, side, canaries_only

    def forward(self, x):
        x_side = plain(x)  # the control breaks the mechanism on purpose: dpzoo's loss tracker must not see side
        out = self.private(x) + self.side(x_side)
        if self.canaries_only:
            out = out - self.side(torch.cat([x_side[:, :-1], torch.zeros_like(x_side[:, -1:])], 1))
        return out


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
    on_private=None,
    physical_batch_size=None,
    loss_scale=None,
    mode="auto",
    noise_multiplier=None,
    max_steps=None,
):
    """One private training run with dpzoo's engine (or a deliberately broken variant).

        The training path under audit: ``physical_batch_size`` steps through dpzoo's
        ``BatchMemoryManager`` (micro-batches of at most that many examples, one noisy step per
        logical batch); ``loss_scale`` runs the forward pass in float16 autocast with a
        ``DPGradScaler`` at that scale; ``mode`` is the engine's training mode (``"bitfit"``,
        ``"lora"``, ...), with the optimizer over the parameters it trains. ``noise_multiplier``: this σ
    instead of the one that spends ``epsilon``; ``max_steps``: stop after that many steps (the epochs
    then run as many as needed). Returns (released model, claimed ε at δ, mechanism settings)."""
    from ..privacy import Accountant, PrivacyEngine
    from ..privacy.fsdp import is_fsdp2
    from ..privacy.modes import mode_trainable

    model = model_fn().train()
    sharded = is_fsdp2(model)  # FSDP2: every rank runs every pass, and no single-sample self-check
    _refuse_control(broken, mode, sharded)
    side, side_opt, side_std = _outside_engine(model, model_fn, broken, lr)
    engine = PrivacyEngine(accountant=accountant)
    trained = mode_trainable(mode, model)
    opt = torch.optim.SGD([p for p in model.parameters() if id(p) in trained], lr=lr)
    claimed_sigma = None
    if broken in RECALIBRATED:
        claimed_sigma = noise_multiplier or _sigma_for(epsilon, delta, len(train_set), batch_size, epochs, accountant)
    noise, clip = _noise_and_clip(broken, epsilon, noise_multiplier, claimed_sigma, max_grad_norm)
    seeds = {k: v for k, v in (("noise_seed", noise_seed), ("sample_seed", sample_seed)) if v is not None}
    settings = dict(target_delta=delta, epochs=epochs, max_grad_norm=clip, clipping=clipping, mode=mode)
    model, opt, loader = _make_private(
        engine, model, opt, DataLoader(train_set, batch_size=batch_size), broken, settings | noise | seeds, sharded
    )
    q = engine.sample_rate  # the rate the engine samples at (under DDP, over all ranks)
    intended = claimed_sigma if claimed_sigma is not None else engine.noise_multiplier
    if broken == "noise-skipped-per-epoch":
        _skip_noise_per_epoch(opt, len(loader))
    if on_private is not None:  # the white-box observer: the claimed mechanism, and the released sums
        claim = {"noise_multiplier": intended, "max_grad_norm": max_grad_norm, "sample_rate": q, "clipping": clipping}
        # a model trained outside the engine releases its own sums: the observer watches those
        on_private(side or model, side_opt or opt, claim | {"sum_scale": engine.expected_batch_size})
    released = _OutsideEngine(model, side, broken == "group-outside-engine") if side is not None else model
    epochs = epochs if max_steps is None else -(-max_steps // len(loader))  # as many as the steps need
    claim_note = f" (claimed: {intended:.3f})" if claimed_sigma is not None else ""
    side_note = ", plus a copy trained outside the engine" if side is not None else ""
    sigma = f"σ = {engine.noise_multiplier:.3f}{claim_note}"
    log(f"training: {len(train_set)} examples, q = {q:.4f}, {sigma}, R = {clip:g}, {epochs} epochs{side_note}")
    steps_run = max_steps or epochs * len(loader)
    bar_args = (steps_run, f"audit ({broken})" if broken else "audit", progress, lambda: engine.get_epsilon(delta))
    paths = (physical_batch_size, loss_scale, sharded)
    side_args = (side_opt, side_std * max_grad_norm, batch_size)
    _train_steps(engine, released, loss_fn, loader, opt, epochs, max_steps, bar_args, paths, side_args)
    engine.detach()
    steps = int(engine.steps)  # the accountant's count: logical steps, whatever the micro-batching
    claimed = engine.get_epsilon(delta)
    if claimed_sigma is not None:  # the engine ran another σ or R: the claim is the intended mechanism's
        claimed = Accountant(accountant, [[intended, q, steps]]).get_epsilon(delta)
    mech = {
        "noise_multiplier": float(engine.noise_multiplier),
        "claimed_noise_multiplier": float(intended),
        "max_grad_norm": max_grad_norm,
        "actual_max_grad_norm": clip,
        "clipping": clipping,
        "sample_rate": q,
        "steps": steps,
        "epochs": epochs,
    }
    return released, claimed, mech | _run_settings(batch_size, lr, accountant, broken, mode)


def _sigma_for(epsilon, delta, examples: int, batch_size: int, epochs: int, accountant: str) -> float:
    """The σ that spends ``epsilon`` over the planned steps (a control's claim)."""
    from ..privacy import get_noise_multiplier
    from ..privacy.distributed import world_and_rank

    world, _ = world_and_rank()  # under DDP each rank draws its shard at the same expected batch size
    q = min(1.0, batch_size * world / examples)
    return get_noise_multiplier(epsilon, delta, q, epochs * max(1, round(examples / batch_size)), accountant)


def _make_private(engine, model, opt, loader, broken, settings: dict, sharded: bool):
    """``engine.make_private`` on the run's model, optimizer and loader with ``settings`` (noise,
    clipping, seeds); a control that breaks the mechanism on purpose is not warned about it."""
    with warnings.catch_warnings():
        if broken is not None:
            warnings.simplefilter("ignore", WeakPrivacyWarning)
        return engine.make_private(module=model, optimizer=opt, data_loader=loader, self_check=not sharded, **settings)


def _run_settings(batch_size, lr, accountant, broken, mode) -> dict:
    """The rest of the mechanism's record: what the run was asked for."""
    return {
        "batch_size": batch_size,
        "lr": lr,
        "accountant": accountant,
        "optimizer": "SGD",
        "outside_engine": OUTSIDE.get(broken),
        "mode": mode,
    }


def _noise_and_clip(broken, epsilon, noise_multiplier, claimed_sigma, max_grad_norm) -> tuple[dict, float]:
    """(make_private's noise arguments, the clipping bound the engine runs): the claim, or a control's
    deliberately broken mechanism (no noise, a scaled sensitivity, half the noise)."""
    noise = dict(target_epsilon=epsilon) if noise_multiplier is None else dict(noise_multiplier=noise_multiplier)
    if broken == "no-noise":
        return dict(noise_multiplier=0.0), max_grad_norm
    if broken in SCALED:
        return dict(noise_multiplier=claimed_sigma / SCALED[broken]), max_grad_norm * SCALED[broken]
    if broken == "half-noise":
        return dict(noise_multiplier=claimed_sigma / 2), max_grad_norm
    return noise, max_grad_norm


def _train_steps(engine, released, loss_fn, loader, opt, epochs, max_steps, bar_args, paths, side) -> None:
    """The audited run's steps, on the training path under audit (micro-batches, float16 with a
    scaler); a copy trained outside the engine (``side``) takes its noisy unclipped step beside."""
    steps_run, desc, progress, epsilon = bar_args
    physical_batch_size, loss_scale, sharded = paths
    side_opt, side_std, batch_size = side  # side_std: the noise std of the side copy per unit σ (times R)
    with (
        StepBar(steps_run, desc, enabled=progress, epsilon=epsilon) as bar,
        _path(loader, opt, physical_batch_size, loss_scale) as (batches, backward, step),
    ):
        for _ in range(epochs):
            for x, y in batches:
                if max_steps is not None and engine.steps >= max_steps:
                    break
                loss = None
                # an empty Poisson batch: no backward (under FSDP2 one of 0 rows: the passes are
                # collective), the optimizer still adds noise and counts the step
                if len(y) or sharded:
                    with torch.autocast("cpu", dtype=torch.float16, enabled=loss_scale is not None):
                        loss = loss_fn(released(x), y)
                    backward(loss)
                step()
                opt.zero_grad()
                if side_opt is not None:
                    _noisy_unclipped_step(side_opt, len(y), side_std * engine.noise_multiplier, batch_size)
                bar.step(None if loss is None else loss.detach())


@contextmanager
def _path(loader, opt, physical_batch_size, loss_scale):
    """(batches to iterate, backward(loss), step()) for the training path under audit."""
    from ..privacy import BatchMemoryManager, DPGradScaler

    scaler = DPGradScaler(opt, loss_scale) if loss_scale is not None else None
    backward = (lambda loss: scaler.scale(loss).backward()) if scaler else (lambda loss: loss.backward())
    step = (lambda: (scaler.step(opt), scaler.update())) if scaler else opt.step
    if physical_batch_size is None:
        yield loader, backward, step
        return
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical_batch_size, optimizer=opt) as batches:
        yield batches, backward, step


OUTSIDE = {
    "unclipped": "a model copy trained by plain SGD on noised, unclipped gradients",
    "group-outside-engine": "the canaries' coordinates, trained by plain SGD on raw gradients (no clipping, no noise)",
}


def _refuse_control(broken, mode: str, sharded: bool) -> None:
    """Controls a path would silently undo: the bias-only and LoRA modes re-enable the group frozen
    for "group-outside-engine"; FSDP2's sharded noise does not pass the hook "noise-skipped-per-epoch"
    patches."""
    from ..errors import DPZooError

    if broken in OUTSIDE and mode in ("bitfit", "lora"):
        raise DPZooError(f"broken={broken!r} trains a copy outside the engine in the default mode; drop mode={mode!r}.")
    if broken == "noise-skipped-per-epoch" and sharded:
        raise DPZooError("broken='noise-skipped-per-epoch' patches the replicated-parameter noise; not under FSDP2.")


def _outside_engine(model: nn.Module, model_fn, broken, lr):
    """(side model, its plain optimizer, its noise as a multiple of σR) for the controls that
    train outside the engine, else Nones. "group-outside-engine": the private model's canary
    coordinates are frozen and the side's are the only ones it trains."""
    if broken not in OUTSIDE:
        return None, None, 0.0
    side = model_fn().train()
    if broken == "unclipped":
        return side, torch.optim.SGD(side.parameters(), lr=lr), 1.0
    group = model.canary_parameters()
    for p in group:
        p.requires_grad_(False)
    own = {id(p) for p in side.canary_parameters()}
    for p in side.parameters():
        p.requires_grad_(id(p) in own)
    return side, torch.optim.SGD([p for p in side.parameters() if id(p) in own], lr=lr), 0.0


def _skip_noise_per_epoch(opt, steps_per_epoch: int) -> None:
    """The "noise-skipped-per-epoch" bug, injected into this engine's optimizer: the first step of
    every epoch writes the clipped sum without its noise draw."""
    noised = opt.replicated_grad

    def replicated_grad(p, summed):
        if opt.steps % steps_per_epoch == 0:
            return torch.zeros_like(p) if summed is None else summed.to(p.dtype)
        return noised(p, summed)

    opt.replicated_grad = replicated_grad


def _noisy_unclipped_step(opt: torch.optim.Optimizer, batch: int, std: float, expected_batch: float) -> None:
    """The controls outside the engine: DP-SGD's update without the clipping. The sum of the raw
    per-sample gradients (``batch`` times the mean-loss gradient) plus N(0, std²) (the engine's
    σR for "unclipped", none for "group-outside-engine"), divided by the expected batch size as
    the engine does, then a plain optimizer step."""
    with torch.no_grad():
        for group in opt.param_groups:
            for p in group["params"]:
                total = p.grad * batch if p.grad is not None else torch.zeros_like(p)
                p.grad = (total + std * torch.randn_like(p)) / expected_batch
    opt.step()
    opt.zero_grad()
