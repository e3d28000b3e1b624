"""DP-FROST: private selection of the parameter partitions to fine-tune (§4.5–4.7, App. C).

:func:`select` splits the parameters into partitions, splits the privacy budget between
selection and DP-SGD (:func:`compute_sigma`, Algorithm 3), runs PSEL (Algorithm 4) with noisy
partition-wise gradient magnitudes (:mod:`.magnitudes`) estimated by PGM-EST
(:mod:`.estimation`), freezes every unselected parameter and returns a
:class:`FrostSelection` whose accountant already holds the selection's cost, ready for
``dpzoo.PrivacyEngine(accountant=selection.accountant)`` or ``selection.make_private(...)``.

Decisions where the paper leaves a choice open (docs/DESIGN.md):

* The classifier head of a new task (``always_train="auto"``: the module the engine's BiTFiT mode
  trains) is always trained: it is randomly initialised, so its gradient says nothing about
  what to unfreeze. It is outside the partitions and outside |Θ| of the ratio γ.
* Algorithm 4 stops adding partitions at the first one that would overflow the size budget;
  dpzoo skips it and goes on to the next largest that fits (§4.5 asks for the maximum set of
  the largest-magnitude partitions within γ|Θ|).
* The selection forward passes run in eval mode (no dropout): the magnitudes are those of the
  deterministic network.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..errors import AccountingError, DPZooError, InvalidArgumentError, ReproducibleNoiseWarning
from ..privacy.accounting.accountant import Accountant, accountant_spec, get_noise_multiplier
from ..privacy.bitfit import default_head
from ..privacy.caller import first_frame_outside_dpzoo
from ..privacy.data import secret_generator
from ..privacy.engine import PrivacyEngine
from ..privacy.metadata import check_delta
from ..runs.progress import StepBar
from . import magnitudes as MG
from .partitions import Partition, resolve_partitions
from .psel import PartitionGradientMeasure, default_loss, psel

__all__ = ["FrostSelection", "select", "compute_sigma", "psel", "default_loss"]


@dataclass
class FrostSelection:
    selected: list[Partition]
    partitions: list[Partition]
    always_train: list[str]
    estimates: dict[str, float]  # PGM-EST's ν per partition (noisy, private)
    noise_multiplier: float  # σ_SGD for the DP-SGD that follows
    selection_noise_multiplier: float  # σ_ps
    sample_rate: float  # q_ps
    iterations: int  # T
    accountant: Accountant  # holds the selection's (σ_ps, q_ps, T)
    target_epsilon: float
    target_delta: float
    sgd_sample_rate: float
    sgd_steps: int
    samples_seen: int
    history: list[dict] = field(default_factory=list)

    @property
    def parameter_names(self) -> list[str]:
        """What stays trainable: the selected partitions and the always-trained head."""
        return [n for p in self.selected for n in p.params] + list(self.always_train)

    @property
    def selected_size(self) -> int:
        return sum(p.size for p in self.selected)

    @property
    def total_size(self) -> int:
        return sum(p.size for p in self.partitions)

    def make_private(self, *, module: nn.Module, optimizer, data_loader, **kwargs):
        """``PrivacyEngine(accountant=self.accountant).make_private(...)`` with σ_SGD from
        ComputeSigma. Returns (engine, model, optimizer, data_loader)."""
        if "noise_multiplier" in kwargs or "target_epsilon" in kwargs:
            raise DPZooError(
                "the selection fixed the DP-SGD noise (ComputeSigma); do not pass noise_multiplier "
                "or target_epsilon, or use PrivacyEngine(accountant=selection.accountant) yourself."
            )
        bs = getattr(data_loader, "batch_size", None)
        if bs is None or abs(bs / len(data_loader.dataset) - self.sgd_sample_rate) > 1e-12:
            raise DPZooError(
                f"the data loader's batch size gives sample rate {bs}/{len(data_loader.dataset)}, but the "
                f"budget was split for {self.sgd_sample_rate:.6g}: pass the same batch_size to select()."
            )
        engine = PrivacyEngine(accountant=self.accountant)
        model, opt, loader = engine.make_private(
            module=module,
            optimizer=optimizer,
            data_loader=data_loader,
            noise_multiplier=self.noise_multiplier,
            target_delta=self.target_delta,
            **kwargs,
        )
        return engine, model, opt, loader

    def summary(self) -> str:
        return (
            f"DP-FROST selected {len(self.selected)}/{len(self.partitions)} partitions, "
            f"{self.selected_size:,}/{self.total_size:,} parameters "
            f"({100 * self.selected_size / max(1, self.total_size):.1f}%) + head {len(self.always_train)} tensors; "
            f"σ_ps = {self.selection_noise_multiplier:.3g} (q = {self.sample_rate}, T = {self.iterations}), "
            f"σ_SGD = {self.noise_multiplier:.3g}"
        )


def compute_sigma(
    target_epsilon: float,
    target_delta: float,
    sgd_sample_rate: float,
    sgd_steps: int,
    selection_sample_rate: float,
    selection_steps: int,
    budget_ratio: float = 0.9,
    accountant: str = "rdp",
) -> tuple[float, float]:
    """ComputeSigma (App. C, Algorithm 3): σ_SGD spends budget_ratio·ε alone; σ_ps is the
    smallest noise for which selection and DP-SGD together spend ≤ ε (library accountant,
    bisection as Algorithm 2)."""
    if not 0 < budget_ratio < 1:
        raise InvalidArgumentError(f"budget_ratio={budget_ratio} is out of range; pass a value in (0, 1), e.g. 0.9.")
    if not accountant_spec(accountant).composes_history:
        raise AccountingError(
            f"DP-FROST composes selection and DP-SGD, but accountant={accountant!r} does not compose a "
            "history (it would count only the last mechanism and under-report ε): use accountant='pld' or "
            "'rdp' (dp-accounting) or 'prv' (Opacus)."
        )
    sigma_sgd = get_noise_multiplier(
        budget_ratio * target_epsilon, target_delta, sgd_sample_rate, sgd_steps, accountant
    )
    sigma_ps = get_noise_multiplier(
        target_epsilon,
        target_delta,
        selection_sample_rate,
        selection_steps,
        accountant,
        history=[(sigma_sgd, sgd_sample_rate, sgd_steps)],
    )
    return sigma_sgd, sigma_ps


def _head_params(model: nn.Module, always_train) -> list[str]:
    if always_train == "auto":
        heads = default_head(model)
    else:
        heads = list(always_train or [])
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    out = []
    for h in heads:
        hit = [n for n in names if n == h or n.startswith(h + ".")]
        if not hit:
            raise DPZooError(f"always_train: {h!r} names no trainable parameter or module of the model")
        out += [n for n in hit if n not in out]
    return out


def _selection_generator(seed: int | None) -> torch.Generator:
    """The generator of the selection's subsampling and noise: OS entropy (secret, whatever
    torch's seed), or ``seed``'s, which warns as the engine's seeds do (reproducible: not secret)."""
    if seed is None:
        return secret_generator()
    warnings.warn(
        f"seed={seed}: DP-FROST's selection noise and subsampling are reproducible, so they are not secret: "
        "the guarantee does not hold against anyone who holds the seed. Leave it None outside tests.",
        ReproducibleNoiseWarning,
        stacklevel=first_frame_outside_dpzoo(),
    )
    return torch.Generator().manual_seed(seed)


def select(
    model: nn.Module,
    data_loader: DataLoader,
    target_epsilon: float,
    target_delta: float,
    ratio: float = 0.25,
    *,
    epochs: int,
    batch_size: int | None = None,
    budget_ratio: float = 0.9,
    method: str = "mgna",
    alpha: int = 1,
    clip: float = 1.0,
    iterations: int = 5,
    sample_rate: float = 0.02,
    gap: float = 5.0,
    single: bool = False,
    partitions=None,
    always_train="auto",
    loss_fn=None,
    max_physical_batch_size: int = 16,
    accountant: str = "rdp",
    selection_noise_multiplier: float | None = None,
    seed: int | None = None,
    pgm_iterations: int = 1000,
    freeze: bool = True,
    progress: bool | None = None,
    accept_large_delta: bool = False,
) -> FrostSelection:
    """Select privately which partitions to fine-tune, freeze the rest (DP-FROST, Algorithm 1).

    ``target_epsilon`` / ``target_delta`` are the budget of selection *and* the DP-SGD that
    follows (``epochs`` at the data loader's ``batch_size``, Poisson sampled as dpzoo's engine
    does); ``budget_ratio`` (r_ε) of it goes to DP-SGD. ``ratio`` (γ) is the largest fraction
    of the partitions' parameters to unfreeze; ``iterations`` (T), ``sample_rate`` (q_ps) and
    ``gap`` (v) are PSEL's; ``single=True`` selects at once (T = 1, the paper's SINGLE).
    ``loss_fn(model, batch)`` must return the *sum* of the batch's per-example losses (default:
    cross-entropy on (inputs…, labels) or dicts with "labels"). ``selection_noise_multiplier``
    overrides σ_ps (0 = no noise, ε = ∞: for tests only). ``progress``: a bar over the
    iterations with the selection's ε so far (None: when stderr is a terminal).
    ``accept_large_delta``: allow δ ≥ 1/N, as ``make_private`` does (then pass it there too).
    ``seed``: makes the selection's subsampling and noise reproducible, and therefore not secret
    (tests only); None (the default) draws them from OS entropy, whatever torch's seed.
    """
    _check_arguments(ratio, sample_rate, iterations, epochs, method, alpha)
    iterations = 1 if single else iterations
    dataset = data_loader.dataset
    n = len(dataset)
    check_delta(target_delta, n, accept_large_delta)  # before any private data is measured
    batch_size = batch_size or data_loader.batch_size
    if not batch_size:
        raise DPZooError("select needs the DP-SGD batch size: a data loader with batch_size, or batch_size=")
    sgd_rate = batch_size / n
    sgd_steps = epochs * max(1, round(1 / sgd_rate))  # what dpzoo's engine will run
    head = _head_params(model, always_train)
    parts = resolve_partitions(model, partitions, exclude=head)
    if not parts:
        raise DPZooError("no partition to select from: the model has no trainable parameter outside always_train")

    sigma_sgd, sigma_ps = compute_sigma(
        target_epsilon, target_delta, sgd_rate, sgd_steps, sample_rate, iterations, budget_ratio, accountant
    )
    if selection_noise_multiplier is not None:
        sigma_ps = float(selection_noise_multiplier)
        if sigma_ps == 0:
            warnings.warn("DP-FROST selection without noise: not differentially private (ε = ∞)")
    gen = _selection_generator(seed)
    measure = PartitionGradientMeasure(
        model, dataset, data_loader.collate_fn, loss_fn or default_loss, method, alpha, clip, max_physical_batch_size
    )
    psel_args = (parts, n, sigma_ps, sample_rate, iterations, ratio, gap, method, alpha, clip)
    chosen, estimates, log, acc = _psel_accounted(
        measure, psel_args, gen, pgm_iterations, accountant, target_delta, progress
    )
    if freeze:
        keep = {n for p in chosen for n in p.params} | set(head)
        for name, p in model.named_parameters():
            p.requires_grad_(p.requires_grad and name in keep)
    return FrostSelection(
        selected=chosen,
        partitions=parts,
        always_train=head,
        estimates=estimates,
        noise_multiplier=sigma_sgd,
        selection_noise_multiplier=sigma_ps,
        sample_rate=sample_rate,
        iterations=iterations,
        accountant=acc,
        target_epsilon=target_epsilon,
        target_delta=target_delta,
        sgd_sample_rate=sgd_rate,
        sgd_steps=sgd_steps,
        samples_seen=measure.samples,
        history=log,
    )


def _check_arguments(ratio, sample_rate, iterations, epochs, method, alpha) -> None:
    if not 0 < ratio <= 1:
        raise DPZooError(f"ratio (γ, the fraction of parameters to unfreeze) must be in (0, 1], got {ratio}")
    if not 0 < sample_rate <= 1:
        raise DPZooError(f"sample_rate (q_ps) must be in (0, 1], got {sample_rate}")
    if iterations < 1 or epochs < 1:
        raise DPZooError(f"iterations and epochs must be >= 1, got {iterations}, {epochs}")
    if method not in MG.METHODS or alpha not in (1, 2):
        raise DPZooError(f"method must be one of {MG.METHODS} and alpha 1 or 2, got {method!r}, {alpha!r}")


def _psel_accounted(measure, psel_args, gen, pgm_iterations, accountant, target_delta, progress):
    """(chosen, estimates, log, accountant) of :func:`psel` with ``psel_args``; every noisy release
    is recorded in the accountant as it is made, and a count other than one per iteration refused."""
    sigma_ps, sample_rate, iterations = psel_args[2], psel_args[3], psel_args[4]
    acc = Accountant(accountant)  # one step per noisy release, as psel makes them

    def released(t: int) -> None:
        acc.step(sigma_ps, sample_rate)
        bar.step()

    # no loss to show: the selection has none of its own; ε is the selection's spend so far
    with StepBar(
        iterations, "DP-FROST selection", enabled=progress, epsilon=lambda: acc.get_epsilon(target_delta)
    ) as bar:
        chosen, estimates, log = psel(measure, *psel_args, gen, pgm_iterations, on_iteration=released)
    if acc.steps != iterations:  # psel releases once per iteration; anything else would misstate ε
        raise AccountingError(f"DP-FROST selection made {acc.steps} releases for {iterations} iterations.")
    return chosen, estimates, log, acc
