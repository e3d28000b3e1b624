"""``dpzoo.PrivacyEngine``: turn a model, an optimizer and a data loader into DP training.

    engine = dpzoo.PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader,
        target_epsilon=8, target_delta=1e-5, epochs=3,        # or noise_multiplier=...
        max_grad_norm=1.0, clipping="abadi", mode="auto")
    for x, y in loader:                                        # Poisson-sampled batches
        loss = criterion(model(x), y)                          # mean (or sum: loss_reduction="sum")
        loss.backward()                                        # BK: no weight gradient is computed
        optimizer.step(); optimizer.zero_grad()
    engine.get_epsilon(1e-5)

Modes (BK paper §2–3; DP-BiTFiT): ``"bk"`` ghost norm on every generalised linear layer;
``"bk-mixopt"`` (= ``"auto"``) ghost norm or per-sample instantiation per layer, whichever is
cheaper (2T² < p·d); ``"instantiate"`` per-sample gradients everywhere (Opacus-style);
``"bitfit"`` trains only biases (plus ``train_head``), activation-free (DP-BiTFiT Alg. 1).
"""

from __future__ import annotations

import fnmatch
import math
import numbers
import warnings
import weakref
from typing import Any, Iterable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import DataLoader, DistributedSampler

from ..errors import DPZooError, PrivacyUsageError, ReproducibleNoiseWarning
from ..grad_norms import attach_norm_hooks
from .accountant import Accountant, accountant_spec, get_noise_multiplier
from .data import DPDataLoader, StepSignal, dataset_fingerprint
from .modes import MODES
from .optimizer import CLIPPING, DPOptimizer, _world
from .verify import self_check

__all__ = ["PrivacyEngine", "MODES", "freeze_all_but_biases", "sample_mixing_modules"]


def _is_bias(name: str) -> bool:
    return name.rsplit(".", 1)[-1].endswith("bias")


def freeze_all_but_biases(model: nn.Module, train_head: Iterable[str] | str | None = None) -> list[str]:
    """DP-BiTFiT: only biases (and modules matching ``train_head`` patterns) stay trainable.

    Returns the names of the trainable parameters.
    """
    keep = _bitfit_trainable(model, train_head)
    trainable = []
    for name, p in model.named_parameters():
        p.requires_grad_(id(p) in keep)
        if id(p) in keep:
            trainable.append(name)
    return trainable


def _default_head(model: nn.Module) -> list[str]:
    cfg = getattr(model, "pretrained_cfg", None) or {}
    if cfg.get("classifier"):
        return [cfg["classifier"]]
    for name in ("classifier", "score", "fc", "head"):
        if isinstance(getattr(model, name, None), nn.Module):
            return [name]
    return []


def _bitfit_trainable(model: nn.Module, train_head) -> set[int]:
    """ids of the parameters DP-BiTFiT trains: biases and ``train_head`` patterns (no mutation)."""
    heads = [train_head] if isinstance(train_head, str) else list(train_head or [])
    keep = set()
    for name, p in model.named_parameters():
        module = name.rpartition(".")[0]
        if _is_bias(name) or any(fnmatch.fnmatch(module, h) or fnmatch.fnmatch(name, h) for h in heads):
            keep.add(id(p))
    return keep


def _number(name: str, value, *, positive: bool = False, integer: bool = False, fix: str = "") -> None:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok and integer:
        ok = float(value).is_integer()
    if ok and positive:
        ok = value > 0
    elif ok:
        ok = value >= 0
    if not ok:
        kind = ("a positive integer" if integer else "a finite number > 0") if positive else "a finite number >= 0"
        raise PrivacyUsageError(f"{name} must be {kind}, got {value!r}" + (f": {fix}" if fix else "."))


def sample_mixing_modules(model: nn.Module) -> list[str]:
    """Modules that make one sample's output depend on others in train mode, or whose running
    statistics update from the batch (released without noise): BatchNorm of any kind, with or
    without affine parameters, and instance norms that track running statistics."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, _BatchNorm) and m.training:
            out.append(f"{name or '<root>'} ({type(m).__name__})")
        elif isinstance(m, nn.modules.instancenorm._InstanceNorm) and m.track_running_stats and m.training:
            out.append(f"{name or '<root>'} ({type(m).__name__}, track_running_stats=True)")
    return out


def _checksums(module: nn.Module) -> dict[str, tuple[float, float]]:
    """Two sums per parameter (plain and squared, float64): a cheap fingerprint of its values."""
    with torch.no_grad():
        return {n: (float(p.double().sum()), float(p.double().pow(2).sum())) for n, p in module.named_parameters()}


class PrivacyEngine:
    """Opacus-like entry point to dpzoo's DP training (see the module docstring)."""

    def __init__(self, accountant: "str | Accountant" = "rdp"):
        # an Accountant instance may already hold spent budget (e.g. dpzoo.frost.select's):
        # calibration and get_epsilon compose training after it
        self.accountant = accountant if isinstance(accountant, Accountant) else Accountant(accountant)
        spec = accountant_spec(self.accountant.name)
        if not spec.upper_bound:  # registered with upper_bound=False (e.g. "gdp")
            raise PrivacyUsageError(
                f"accountant={spec.name!r} is refused for training: "
                + (spec.caveat or "its ε is not an upper bound (it may under-report)")
                + ". Use 'pld' (tight), 'prv' or 'rdp'."
            )
        self.hooks = None
        self.optimizer: DPOptimizer | None = None
        self.module: nn.Module | None = None
        self.target_delta: float | None = None
        self.mode: str | None = None
        self.self_check_result: str | None = None
        self._handles: list = []

    # -- set-up ------------------------------------------------------------------------------
    def make_private(
        self,
        *,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        data_loader: DataLoader,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        target_delta: float | None = None,
        epochs: int | None = None,
        max_grad_norm: float = 1.0,
        clipping: str = "abadi",
        mode: str = "auto",
        loss_reduction: str = "mean",
        poisson_sampling: bool = True,
        max_physical_batch_size: int | None = None,
        train_head: Iterable[str] | str | None = "auto",
        noise_seed: int | None = None,
        sample_seed: int | None = None,
        self_check: bool = True,
        self_check_samples: int = 3,
    ):
        """Make ``module``, ``optimizer`` and ``data_loader`` private. Returns all three, wrapped.

        Either ``noise_multiplier`` or ``target_epsilon`` (with ``target_delta`` and
        ``epochs``) sets the noise. The data loader's ``batch_size`` becomes the expected
        logical batch size (per rank under torch.distributed): sample rate
        q = batch_size · world size / len(dataset). The returned loader Poisson-samples the
        dataset (each rank its own shard of it); train on its batches only.

        Refused with a :class:`~dpzoo.DPZooError`, because ε would be false otherwise: an
        optimizer whose trainable parameters are not exactly the model's; modules that mix
        samples (BatchNorm); ``poisson_sampling=False``; different datasets on different ranks.
        On the first step, the self-check compares dpzoo's per-sample norms with single-sample
        backward passes (:mod:`dpzoo.privacy.verify`); ``self_check=False`` skips it (recorded
        in the privacy metadata). ``noise_seed`` / ``sample_seed`` make noise / sampling
        reproducible and not secret (tests only; recorded in the metadata).
        """
        if self.module is not None:
            raise PrivacyUsageError("This PrivacyEngine already made a model private; use a new engine.")
        if isinstance(module, nn.parallel.DistributedDataParallel):
            raise PrivacyUsageError(
                "Pass the model unwrapped, not in DistributedDataParallel: dpzoo sums the clipped gradients across "
                "ranks itself (DDP would all-reduce non-private gradients). Initialise torch.distributed and call "
                "make_private on each rank."
            )
        if not isinstance(module, nn.Module):
            raise PrivacyUsageError(f"module must be a torch.nn.Module, got {type(module).__name__}.")
        if isinstance(optimizer, DPOptimizer):
            raise PrivacyUsageError("optimizer is already a dpzoo DPOptimizer: pass the plain torch optimizer.")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise PrivacyUsageError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}.")
        if mode not in MODES:
            raise PrivacyUsageError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if clipping not in CLIPPING:
            raise PrivacyUsageError(f"clipping must be one of {', '.join(CLIPPING)}, got {clipping!r}")
        if loss_reduction not in ("mean", "sum"):
            raise PrivacyUsageError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if (noise_multiplier is None) == (target_epsilon is None):
            raise PrivacyUsageError("Give either noise_multiplier or target_epsilon (with target_delta and epochs).")
        if target_epsilon is not None:
            if target_delta is None or epochs is None:
                raise PrivacyUsageError("target_epsilon needs target_delta and epochs to calibrate the noise.")
            _number("target_epsilon", target_epsilon, positive=True, fix="pass the privacy budget ε, e.g. 8")
            _number("epochs", epochs, positive=True, integer=True, fix="pass how many epochs you will train")
        else:
            _number("noise_multiplier", noise_multiplier, fix="pass σ >= 0 (0 means no privacy)")
        if target_delta is not None and not (isinstance(target_delta, numbers.Real) and 0 < target_delta < 1):
            raise PrivacyUsageError(f"target_delta must be in (0, 1), got {target_delta!r}: use δ < 1/N, e.g. 1e-5.")
        _number("max_grad_norm", max_grad_norm, positive=True, fix="pass the clipping bound R, e.g. 1.0")
        if max_physical_batch_size is not None and not isinstance(max_physical_batch_size, numbers.Integral):
            raise PrivacyUsageError(
                f"max_physical_batch_size must be a positive integer, got {max_physical_batch_size!r}."
            )
        if max_physical_batch_size is not None:
            _number(
                "max_physical_batch_size",
                max_physical_batch_size,
                positive=True,
                integer=True,
                fix="pass the largest micro-batch that fits in memory, or None for no splitting",
            )
        _number("self_check_samples", self_check_samples, positive=True, integer=True)
        for name, seed in (("noise_seed", noise_seed), ("sample_seed", sample_seed)):
            if seed is not None and (not isinstance(seed, numbers.Integral) or isinstance(seed, bool)):
                raise PrivacyUsageError(f"{name} must be an int or None (the default: secret), got {seed!r}.")
        if not poisson_sampling:
            raise PrivacyUsageError(
                "poisson_sampling=False is refused: dpzoo accounts DP-SGD as Poisson-subsampled, and the ε of fixed or "
                "shuffled batches is not that (nor simply bounded under add/remove adjacency). Keep "
                "poisson_sampling=True; use max_physical_batch_size to bound memory."
            )
        if not isinstance(data_loader, DataLoader) and not hasattr(data_loader, "dataset"):
            raise PrivacyUsageError(f"data_loader must be a torch DataLoader, got {type(data_loader).__name__}.")
        batch_size = getattr(data_loader, "batch_size", None)
        if batch_size is None:
            raise PrivacyUsageError(
                "The data loader needs a fixed batch_size (no batch_sampler): it sets the expected Poisson batch size."
            )
        lazy = [n for n, p in module.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)]
        if lazy:
            raise PrivacyUsageError(
                f"Parameter(s) {', '.join(lazy[:6])} are not initialised yet (lazy modules): run one forward pass on "
                "a dummy (non-private) batch before make_private, so dpzoo can plan their per-sample gradients."
            )
        renorm = [n or "<root>" for n, m in module.named_modules() if isinstance(m, nn.Embedding) and m.max_norm]
        if renorm:
            raise PrivacyUsageError(
                f"Embedding(s) {', '.join(renorm[:6])} have max_norm: forward renormalises the rows the batch looks "
                "up, in place, which releases which ids the private batch holds. Set max_norm=None."
            )
        mixing = sample_mixing_modules(module)
        if mixing:
            raise PrivacyUsageError(
                f"Module(s) {', '.join(mixing[:6])} mix samples in train mode (batch statistics) and update running "
                "statistics from private data without noise. Convert them with dpzoo.make_dp_ready(model) "
                "(BatchNorm -> GroupNorm), or put them in eval mode and freeze them."
            )
        dataset = data_loader.dataset
        n = len(dataset)
        if n < 1:
            raise PrivacyUsageError("The data loader's dataset is empty.")
        world, rank = _world()
        indices = None
        if world > 1:
            indices = self._shard(data_loader, n, world, rank)
            self._same_on_every_rank(
                world,
                batch_size=batch_size,
                noise_multiplier=noise_multiplier,
                target_epsilon=target_epsilon,
                target_delta=target_delta,
                epochs=epochs,
                max_grad_norm=max_grad_norm,
                clipping=clipping,
                mode=mode,
                loss_reduction=loss_reduction,
                accountant=self.accountant.name,
                history=self.accountant.history,
                max_physical_batch_size=max_physical_batch_size,
                self_check=self_check,
            )
        prior = self._prior_spending(module)
        sample_rate = batch_size * world / n
        if sample_rate > 1:
            raise PrivacyUsageError(
                f"batch_size {batch_size}{f' x {world} ranks' if world > 1 else ''} exceeds the dataset's "
                f"{n} samples (sample rate q = {sample_rate:.3g} > 1): use a batch_size of at most "
                f"{n // world}."
            )
        signal = StepSignal()
        gen = torch.Generator().manual_seed(sample_seed + rank) if sample_seed is not None else None
        loader = DPDataLoader(
            dataset,
            sample_rate,
            collate_fn=data_loader.collate_fn,
            num_workers=data_loader.num_workers,
            max_physical_batch_size=max_physical_batch_size,
            generator=gen,
            signal=signal,
            indices=indices,
        )
        steps_per_epoch = len(loader)
        if prior:  # the model already spent privacy on its data (dpzoo.load, an earlier engine): compose after it
            self.accountant.load_state_dict({"name": self.accountant.name, "history": prior + self.accountant.history})
        if target_epsilon is not None:
            try:
                noise_multiplier = get_noise_multiplier(
                    target_epsilon,
                    target_delta,
                    sample_rate,
                    int(epochs) * steps_per_epoch,
                    self.accountant.name,
                    history=self.accountant.history,
                )
            except ValueError as e:
                if isinstance(e, DPZooError):
                    raise
                raise PrivacyUsageError(f"Cannot calibrate the noise: {e}") from None
        self.accountant.check(float(noise_multiplier), sample_rate)  # e.g. a history this accountant cannot compose
        self.prior_spending = prior
        trainable = (
            _bitfit_trainable(module, _default_head(module) if train_head == "auto" else train_head)
            if mode == "bitfit"
            else {id(p) for p in module.parameters() if p.requires_grad}
        )
        self._check_optimizer(module, optimizer, trainable)
        for name, seed in (("noise_seed", noise_seed), ("sample_seed", sample_seed)):
            if seed is not None:
                warnings.warn(
                    f"{name}={seed}: {'noise' if name == 'noise_seed' else 'Poisson membership'} is "
                    "reproducible, so it is not secret: the guarantee does not hold against anyone who "
                    "holds the seed. Leave it None outside tests.",
                    ReproducibleNoiseWarning,
                    stacklevel=2,
                )
        self.target_delta = target_delta
        self.sample_rate, self.noise_multiplier = sample_rate, float(noise_multiplier)
        self.max_grad_norm, self.clipping, self.loss_reduction = float(max_grad_norm), clipping, loss_reduction
        self.noise_seed, self.sample_seed = noise_seed, sample_seed
        # each rank samples its shard of the one dataset at rate q: the expected global batch is q · N
        self.expected_batch_size = sample_rate * n
        requires = {p: p.requires_grad for p in module.parameters()}
        self.module = module
        try:
            self._notify_noise()
            self._set_mode(mode, train_head)
            self.optimizer = DPOptimizer(
                optimizer,
                hooks=self.hooks,
                noise_multiplier=noise_multiplier,
                max_grad_norm=max_grad_norm,
                clipping=clipping,
                loss_reduction=loss_reduction,
                expected_batch_size=self.expected_batch_size,
                sample_rate=sample_rate,
                accountant=self.accountant,
                signal=signal,
                noise_seed=noise_seed,
            )
        except BaseException:
            if self.hooks is not None:
                self.hooks.detach()
            self.hooks, self.module = None, None
            for p, r in requires.items():
                p.requires_grad_(r)
            raise
        self.optimizer.check_parameters = self._check_step_parameters
        self.optimizer.check_state = self._check_state
        self._buffers_at_step: dict | None = None
        self._param_sums: dict | None = None
        self._self_check, self._check_samples = bool(self_check), int(self_check_samples)
        self._check_inputs = None
        self._in_check = False
        if self._self_check:
            self.optimizer.on_first_step = self._run_self_check
            self.optimizer.capture_inputs = lambda: self._check_inputs
        signal.on_empty = self._noise_only_step
        self._handles = [
            module.register_forward_pre_hook(self._on_forward, with_kwargs=True, prepend=True),
            module.register_forward_hook(self._after_forward),
        ]
        module._dpzoo_engine = weakref.ref(self)
        return module, self.optimizer, loader

    # -- the checks that keep ε true ---------------------------------------------------------
    @staticmethod
    def _shard(data_loader, n: int, world: int, rank: int) -> range:
        """This rank's shard of the one dataset every rank passes (a DistributedSampler's is
        replaced: it pads shards by repeating samples, and dpzoo samples each shard by Poisson)."""
        sampler = getattr(data_loader, "sampler", None)
        if isinstance(sampler, DistributedSampler) and (sampler.num_replicas != world or sampler.rank != rank):
            raise PrivacyUsageError(
                f"The DistributedSampler is for rank {sampler.rank} of {sampler.num_replicas} but this process is "
                f"rank {rank} of {world}: build it from the initialised process group (or pass none)."
            )
        fingerprints: list = [None] * world
        torch.distributed.all_gather_object(fingerprints, dataset_fingerprint(data_loader.dataset))
        if len(set(fingerprints)) > 1:
            raise PrivacyUsageError(
                "The ranks passed different datasets to make_private. Pass the same full dataset on every rank "
                "(with or without a DistributedSampler): dpzoo gives each rank a disjoint shard and Poisson-samples "
                "it, so each sample is counted once. Pre-sharded or overlapping datasets cannot be accounted."
            )
        return range(rank, n, world)

    def _check_optimizer(self, module: nn.Module, optimizer: torch.optim.Optimizer, trainable: set[int]) -> None:
        """The optimizer's trainable parameters must be exactly the model's: one outside the model
        would be updated with its raw gradient; one missing would spend ε on nothing."""
        names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        in_opt = {id(p): p for g in optimizer.param_groups for p in g["params"]}
        outside = [p for pid, p in in_opt.items() if pid not in names and p.requires_grad]
        if outside:
            shapes = ", ".join(str(tuple(p.shape)) for p in outside[:6])
            raise PrivacyUsageError(
                f"The optimizer holds {len(outside)} trainable parameter(s) that are not in the model (shapes "
                f"{shapes}): they would be updated with raw, unclipped gradients. Give the optimizer only "
                "model.parameters(); put every trained module (e.g. a head) inside the model passed to make_private."
            )
        missing = sorted({names[pid] for pid in trainable if pid not in in_opt})
        if missing:
            raise PrivacyUsageError(
                f"Trainable parameter(s) {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''} of the model are "
                "not in the optimizer: they would be clipped and noised but never trained. Pass model.parameters() "
                "to the optimizer, or freeze them (requires_grad_(False)) before make_private."
            )

    def _check_step_parameters(self) -> None:
        """At each step: the optimizer still trains exactly the hooked parameters."""
        hooked = {id(p) for p in self.hooks.trainable_parameters.values() if p.requires_grad}
        names = {id(p): n for n, p in self.module.named_parameters(remove_duplicate=False)}
        in_opt = {id(p): p for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad}
        extra = [p for pid, p in in_opt.items() if pid not in hooked]
        if extra:
            label = ", ".join(names.get(id(p), f"<not in the model, shape {tuple(p.shape)}>") for p in extra[:6])
            raise PrivacyUsageError(
                f"The optimizer now trains parameter(s) dpzoo does not clip: {label}. They would be updated with raw "
                "gradients. Add parameters to the model before make_private (a new engine), not to the optimizer."
            )
        missing = [n for n, p in self.hooks.trainable_parameters.items() if p.requires_grad and id(p) not in in_opt]
        if missing:
            raise PrivacyUsageError(
                f"Trainable parameter(s) {', '.join(missing[:8])} were removed from the optimizer after make_private: "
                "freeze them (requires_grad_(False)) instead."
            )

    def _trainable_changed(self) -> bool:
        hooked = self.hooks.trainable_parameters
        present = {id(p) for p in self.module.parameters()}
        swapped = [n for n, p in hooked.items() if id(p) not in present]
        if swapped:
            raise PrivacyUsageError(
                f"Parameter(s) {', '.join(swapped[:6])} are not in the model during this forward: they were swapped "
                "(torch.func.functional_call, stateless calls) or removed. dpzoo clips the model's own parameters: "
                "call the model itself."
            )
        if any(not p.requires_grad for p in hooked.values()):
            return True
        ids = {id(p) for p in hooked.values()}
        return any(p.requires_grad and id(p) not in ids for p in self.module.parameters())

    def _on_forward(self, module, args, kwargs):
        """Before every training forward: follow freezing/unfreezing, take the previous
        micro-batch, keep the first batch's inputs for the self-check."""
        if self._in_check or not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return None
        if self._trainable_changed():
            if self.optimizer.hooks.step_ready:
                self.optimizer.clip_and_accumulate()
            # re-plan the hooks for the new trainable set; their root pre-hook missed this call
            self._set_mode(self.mode, "keep")
            self.hooks.begin_forward(module, args, kwargs)
        self.optimizer.mark_forward()
        if self._self_check and self.optimizer.on_first_step is not None and self.hooks.forward_calls == 0:
            self._check_inputs = (args, kwargs)
        # Nothing computed from the batch may be stored outside the DP update: buffers are compared by
        # value (`.data` writes move no version counter) from here to the step, in any mode; every
        # parameter by a checksum over the first step (a data-dependent init, a renormalisation).
        if self._buffers_at_step is None:
            self._buffers_at_step = {n: b.detach().clone() for n, b in module.named_buffers()}
        if self._param_sums is None and self.steps == 0:
            self._param_sums = _checksums(module)
        return None

    def _after_forward(self, module, args, output):
        if self._in_check or not torch.is_grad_enabled():
            return None
        self._compare_buffers("a training forward pass")
        return None

    def _compare_buffers(self, when: str) -> None:
        before = self._buffers_at_step
        if before is None:
            return
        now = dict(self.module.named_buffers())
        changed = [
            n
            for n, b in before.items()
            if n not in now or now[n].shape != b.shape or not torch.equal(now[n].detach(), b)
        ]
        changed += [n for n in now if n not in before]
        if changed:
            self._buffers_at_step = None
            raise PrivacyUsageError(
                f"Buffer(s) {', '.join(changed[:6])} changed during {when}: values computed from private data would be "
                "released without noise (and may mix samples). Stop what updates them (a running statistic, an EMA, "
                "a hook) or replace it (dpzoo.make_dp_ready converts BatchNorm)."
            )

    def _check_state(self) -> None:
        """At each step, before noise: buffers unchanged since the step's first forward (backward
        hooks included); on the first step, every parameter unchanged since its first forward."""
        self._compare_buffers("this step (forward, backward or a hook)")
        self._buffers_at_step = None
        if self._param_sums is not None:
            now = _checksums(self.module)
            moved = [n for n, v in self._param_sums.items() if now.get(n) != v]
            self._param_sums = None
            if moved:
                raise PrivacyUsageError(
                    f"Parameter(s) {', '.join(moved[:6])} changed between the first forward pass and optimizer.step(): "
                    "something wrote batch data into them (a data-dependent initialisation, a renormalisation, a "
                    "write through .data), which would be released without noise. Initialise on public data before "
                    "make_private."
                )

    @staticmethod
    def _prior_spending(module: nn.Module) -> list:
        """The (σ, q, steps) history a model already spent: an earlier engine on it, or the privacy
        metadata of a model loaded with dpzoo.load. [] for a model with no record."""
        ref = getattr(module, "_dpzoo_engine", None)
        earlier = ref() if callable(ref) else None
        if earlier is not None and earlier.accountant.history:
            return [list(h) for h in earlier.accountant.history]
        meta = getattr(module, "dpzoo_privacy", None)
        if not meta:
            return []
        if meta.get("noise_multiplier") is None or not meta.get("steps"):
            raise PrivacyUsageError(
                f"This model was trained with DP before (ε = {meta.get('epsilon')}) but its metadata lacks the noise "
                "multiplier to compose with: pass accountant=Accountant(name, history) with the earlier steps, or "
                "`del model.dpzoo_privacy` if the new data is disjoint from the data it was trained on."
            )
        return [[float(meta["noise_multiplier"]), float(meta["sample_rate"]), int(meta["steps"])]]

    @staticmethod
    def _same_on_every_rank(world: int, **settings) -> None:
        mine = {k: repr(v) for k, v in settings.items()}
        gathered: list = [None] * world
        torch.distributed.all_gather_object(gathered, mine)
        diff = sorted({k for other in gathered for k in mine if other.get(k) != mine[k]})
        if diff:
            raise PrivacyUsageError(
                f"make_private got different settings on different ranks ({', '.join(diff)}): every rank must use the "
                "same batch_size, noise, clipping bound, mode and accountant, or the reported ε holds for none."
            )

    def _noise_only_step(self) -> None:
        """An empty Poisson batch: the mechanism still releases a (noise-only) update."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _run_self_check(self) -> None:
        capture = getattr(self.optimizer, "_first_capture", None)
        if capture is None:
            return
        (args, kwargs), cotangents = capture
        self.optimizer._first_capture = None
        self._in_check = True
        try:
            with torch.enable_grad():
                report = self_check(
                    self.module, self.hooks, args, kwargs, cotangents=cotangents, samples=self._check_samples
                )
        except DPZooError as e:
            self.self_check_result = f"failed: {e}"
            raise
        finally:
            self._in_check = False
        self.self_check_result = (
            f"passed on the first step ({len(report.samples)} samples, largest relative "
            f"difference {max(report.worst.values(), default=0.0):.1e})"
        )

    def _notify_noise(self) -> None:
        """Tell every :class:`~dpzoo.privacy.protocols.NoiseAware` module (e.g. DPFormer's
        Re-Attention) what the optimizer adds: σ, R and the expected batch size."""
        from .protocols import NoiseAware

        for m in self.module.modules():  # idempotent: a module reached twice just sets it twice
            if isinstance(m, NoiseAware) and callable(m.set_dp_noise):  # the protocol checks the name only
                m.set_dp_noise(
                    noise_multiplier=self.noise_multiplier,
                    max_grad_norm=self.max_grad_norm,
                    expected_batch_size=self.expected_batch_size,
                )

    def _set_mode(self, mode: str, train_head) -> None:
        if mode == "bitfit" and train_head != "keep":
            heads = _default_head(self.module) if train_head == "auto" else train_head
            freeze_all_but_biases(self.module, heads)
        if self.hooks is not None:
            self.hooks.detach()
        self.hooks = attach_norm_hooks(self.module, MODES[mode], ghost_backward=True)
        self.mode = mode
        if self.optimizer is not None:
            self.optimizer.hooks = self.hooks

    def switch_mode(self, mode: str, train_head: Iterable[str] | str | None = "auto") -> None:
        """Change the algorithm mid-training, e.g. ``"bitfit"`` after X epochs of full DP
        fine-tuning (two-phase X+BiTFiT, DP-BiTFiT App. A.2.2). Accounting continues."""
        if self.module is None:
            raise DPZooError("make_private first.")
        if mode not in MODES:
            raise DPZooError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if self.optimizer.hooks.step_ready or self.optimizer.micro_batches_in_step or self.hooks.forward_calls:
            raise PrivacyUsageError("switch_mode in the middle of a logical step: call optimizer.step() first.")
        self._set_mode(mode, train_head)
        self._check_step_parameters()

    def detach(self) -> None:
        """Remove the hooks (the model is an ordinary model again)."""
        if self.hooks is not None:
            self.hooks.detach()
            self.hooks = None
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- accounting ----------------------------------------------------------------------------
    def get_epsilon(self, delta: float | None = None) -> float:
        delta = delta if delta is not None else self.target_delta
        if delta is None:
            raise DPZooError("get_epsilon needs delta (no target_delta was given to make_private).")
        return self.accountant.get_epsilon(delta)

    @property
    def steps(self) -> int:
        return self.accountant.steps

    def privacy_metadata(self, delta: float | None = None) -> dict[str, Any]:
        """What ``dpzoo.save`` records: ε, δ, accountant, steps, sample rate, σ, R."""
        delta = delta if delta is not None else self.target_delta
        if delta is None:
            raise DPZooError("privacy metadata needs delta: pass it, or target_delta to make_private.")
        eps = self.get_epsilon(delta)
        if self.noise_seed is None:
            noise = "secret (OS entropy)"
        else:
            noise = "reproducible (not private against anyone holding the seed)"
        sampling = (
            "Poisson, secret (OS entropy)"
            if self.sample_seed is None
            else "Poisson, reproducible (membership predictable from the seed)"
        )
        if self.optimizer is not None and self.optimizer.refusal is not None:
            check = self.self_check_result or f"failed: {self.optimizer.refusal}"  # and no step was taken since
        elif not self._self_check:
            check = "skipped by the user (self_check=False)"
        else:
            check = self.self_check_result or "pending (no non-empty step yet)"
        return {
            "epsilon": float(eps),
            "delta": float(delta),
            "accountant": self.accountant.name,
            "steps": int(self.steps),
            "sample_rate": float(self.sample_rate),
            "noise_multiplier": float(self.noise_multiplier),
            "max_grad_norm": float(self.max_grad_norm),
            "privacy_unit": "sample",
            "noise": noise,
            "sampling": sampling,
            "self_check": check,
        }

    def state_dict(self) -> dict:
        """Accountant history and optimizer state, for training checkpoints. No noise state
        unless the noise was made reproducible (``noise_seed``): secret noise leaves nothing
        that predicts it."""
        return {
            "accountant": self.accountant.state_dict(),
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "max_grad_norm": self.max_grad_norm,
            "mode": self.mode,
            "optimizer": self.optimizer.state_dict() if self.optimizer else None,
        }

    def load_state_dict(self, state: dict) -> None:
        self.accountant.load_state_dict(state["accountant"])
        if self.optimizer is not None and state.get("optimizer"):
            self.optimizer.load_state_dict(state["optimizer"])
        if state.get("mode") and state["mode"] != self.mode and self.module is not None:
            self._set_mode(state["mode"], "auto")
