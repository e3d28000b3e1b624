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
faster by a cost model within a memory budget (:mod:`dpzoo.grad_norms.cost`,
``engine.plan()``); ``"instantiate"`` per-sample gradients everywhere (Opacus-style);
``"bitfit"`` trains only biases (plus ``train_head``), activation-free (DP-BiTFiT Alg. 1);
``"lora"`` trains only the LoRA adapters of a PEFT model (:mod:`dpzoo.integrations.peft`).

This module's job is the engine's set-up and what it answers for (mode switches, ε, metadata,
checkpoints); each part it wires has its own module: argument refusals (``arguments``), sample
rate and σ (``budget``), ranks (``distributed``), users (``users``), DP-BiTFiT (``bitfit``), the
checks that keep ε true (``guards``), each forward's and step's duties (``watch``), the optimizer.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..errors import DPZooError, PrivacyUsageError
from ..grad_norms import attach_norm_hooks
from ..grad_norms.cost import check_autotune, check_budget
from ..integrations.peft_statements import mark_weights_unknown, unknown_origin_note
from ..live_ref import LiveRef
from .accounting.accountant import Accountant, accountant_spec
from .arguments import (
    check_make_private,
    refuse_engine_options,
    sample_mixing_modules,
    warn_seeds,
)
from .bitfit import freeze_all_but_biases
from .budget import calibrate, compute_sample_rate, restore_history
from .carried import link_spending, prior_spending, stated_assumptions
from .data import DPDataLoader, StepSignal
from .distributed import RANK_SETTINGS, same_on_every_rank, shard, world_and_rank
from .fsdp import ShardedGrads
from .guards import check_optimizer_parameters, check_step_parameters
from .metadata import check_delta, engine_record
from .model_call import attach_call_hooks
from .modes import MODES, apply_mode, mode_trainable
from .opacus_parity import OpacusParity, opacus_arguments
from .optimizer import DPOptimizer
from .protocols import notify_noise
from .users import user_units
from .watch import TrainingWatch

__all__ = ["PrivacyEngine", "MODES", "freeze_all_but_biases", "sample_mixing_modules", "engine_of"]


def engine_of(module: nn.Module) -> "PrivacyEngine | None":
    """The live :class:`PrivacyEngine` that made ``module`` private, or None (none did, or it is
    gone: the model holds it by a weak reference)."""
    ref = getattr(module, "_dpzoo_engine", None)
    return ref() if callable(ref) else None


class PrivacyEngine(OpacusParity):
    """Opacus-like entry point to dpzoo's DP training (see the module docstring)."""

    def __init__(self, accountant: "str | Accountant" = "rdp", **opacus_options):
        refuse_engine_options(opacus_options)  # e.g. Opacus' secure_mode: one line saying why
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
        self.public_statistics: list[str] = []
        self.target_delta: float | None = None
        self.dataset_size: int | None = None  # N (examples, or users), for the δ < 1/N check
        self.unit_record: dict = {"privacy_unit": "sample"}  # the privacy unit, for the metadata
        self.accept_large_delta = False
        self.mode: str | None = None
        self.memory_budget: float | None = None
        self.autotune: bool | None = None
        self.self_check_result: str | None = None
        self._watch: TrainingWatch | None = None  # the duties around each forward and step
        self.planned_steps: int | None = None  # the steps σ was calibrated for (target_epsilon given)
        self._call_hooks: list = []  # model_call hooks: plain inputs, a transformers labels= loss per sample

    # -- set-up ------------------------------------------------------------------------------
    @opacus_arguments  # Opacus' spellings too (dpzoo.privacy.opacus_parity)
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
        memory_budget: float | None = None,
        autotune: bool | None = None,
        accept_large_delta: bool = False,
        privacy_unit: str = "sample",
        user_ids: Iterable | None = None,
        max_examples_per_user: int | None = None,
        user_sampling: str = "users",
    ):
        """Make ``module``, ``optimizer`` and ``data_loader`` private. Returns all three, wrapped.

        Either ``noise_multiplier`` or ``target_epsilon`` (with ``target_delta`` and ``epochs``) sets
        the noise. The data loader's ``batch_size`` becomes the expected logical batch size (per rank
        under torch.distributed): sample rate q = batch_size · world size / len(dataset). The returned
        loader Poisson-samples the dataset (each rank its own shard of it); train on its batches only.

        Refused with a :class:`~dpzoo.DPZooError`, because ε would be false otherwise: an
        optimizer whose trainable parameters are not exactly the model's; modules that mix
        samples (BatchNorm); ``poisson_sampling=False``; different datasets on different ranks.
        On the first step, the self-check compares dpzoo's per-sample norms with single-sample
        backward passes (:mod:`dpzoo.privacy.verify`); ``self_check=False`` skips it (recorded
        in the privacy metadata). ``noise_seed`` / ``sample_seed`` make noise / sampling
        reproducible and not secret (tests only; recorded in the metadata). ``memory_budget``: bytes
        the per-sample gradients ``mode="auto"`` instantiates may hold (None: half the device's free
        memory; 0: ghost norm everywhere; :meth:`plan` shows the choices); ``autotune``: choose by
        timing each layer's two paths (None: on CUDA; :mod:`dpzoo.grad_norms.cost`).
        A δ ≥ 1/N (N samples) is refused (it allows releasing a sample outright) unless
        ``accept_large_delta=True``, which the privacy metadata records.

        User-level DP (``privacy_unit="user"``, :mod:`dpzoo.privacy.users`): ``user_ids`` gives each
        example's user; ``user_sampling="users"`` samples users (the loader's ``batch_size``: expected
        users per step; q = batch_size / users), at most ``max_examples_per_user`` = k examples each,
        and clips each user's summed gradient to R; ``"examples"`` keeps k examples per user for the
        run and samples and clips examples (ε of a mixture of Gaussians: ``accountant="pld"``). ε
        is per user either way, and N, for δ, counts users.
        """
        if self.module is not None:
            raise PrivacyUsageError("This PrivacyEngine already made a model private; use a new engine.")
        given = dict(locals())  # make_private's own arguments: checked here, compared across ranks below
        # 1. refuse what is malformed or would make ε false (dpzoo.privacy.arguments)
        sharded, batch_size = check_make_private(module, optimizer, data_loader, given)
        n = len(dataset := data_loader.dataset)
        users = user_units(
            privacy_unit, user_ids, max_examples_per_user, n, max_physical_batch_size, user_sampling, sample_seed
        )
        units = users.num_users if users is not None else n  # the privacy units: δ < 1/N counts them
        # 2. this rank's shard, the same data and settings on every rank
        world, rank = world_and_rank()
        indices = None
        if world > 1:
            indices = shard(data_loader, n, world, rank)
            ranked = {k: v for k, v in {**given, "batch_size": batch_size}.items() if k in RANK_SETTINGS}
            same_on_every_rank(world, accountant=self.accountant.name, history=self.accountant.history, **ranked,
                               users=users.fingerprint() if users is not None else None)  # fmt: skip
        if target_delta is not None:
            check_delta(target_delta, units, accept_large_delta)
        # 3. the Poisson-sampling loader, then σ for its steps, composed after what the model spent
        earlier = engine_of(module)
        self.prior_spending = prior = prior_spending(module, earlier.accountant if earlier is not None else None)
        sample_rate = compute_sample_rate(batch_size, world, *((n,) if users is None else users.rate_base))
        self.accountant.group = users.group if users is not None else 1  # k examples per user sampled (ELS)
        signal = StepSignal()
        gen = torch.Generator().manual_seed(sample_seed + rank) if sample_seed is not None else None
        sampler = users.sampler(sample_rate, gen, rank, world) if users is not None else None
        loader = DPDataLoader(dataset, sample_rate, collate_fn=data_loader.collate_fn, num_workers=data_loader.num_workers,
                              max_physical_batch_size=max_physical_batch_size, generator=gen, signal=signal,
                              indices=indices, batch_sampler=sampler)  # fmt: skip
        noise = {k: given[k] for k in ("noise_multiplier", "target_epsilon", "target_delta", "epochs")}
        noise_multiplier = calibrate(
            self.accountant, prior, **noise, sample_rate=sample_rate, steps_per_epoch=len(loader)
        )
        self.planned_steps = int(epochs) * len(loader) if target_epsilon is not None else None  # σ's calibration
        # 4. the optimizer must train exactly the parameters dpzoo will clip
        trainable = mode_trainable(mode, module, train_head)
        check_optimizer_parameters(module, optimizer, trainable)
        warn_seeds(noise_seed, sample_seed)
        # 5. record the mechanism, attach the hooks and the DP optimizer, watch every step
        self._record(given, units, users, sample_rate, noise_multiplier, n)
        self._attach(module, optimizer, mode, train_head, signal)
        self._watch = TrainingWatch(self, signal, replan=lambda: self._set_mode(self.mode, "keep"),
                                    self_check=self_check, self_check_samples=self_check_samples, loader=loader)  # fmt: skip
        self._attach_labels_loss()
        if sharded:  # every rank runs the same collective passes: an empty batch is yielded, not skipped
            self.optimizer.grad_writer = ShardedGrads(self.optimizer)  # reduce-scatter, noise per shard
            signal.on_empty = None
        self._link(module)
        return module, self.optimizer, loader

    def _record(self, g: dict, units: int, users, sample_rate: float, noise_multiplier: float, n: int) -> None:
        """The mechanism make_private set up (``g``: its arguments), as the engine's attributes."""
        self.target_delta, self.dataset_size, self.accept_large_delta = (
            g["target_delta"],
            units,
            bool(g["accept_large_delta"]),
        )
        self.unit_record = users.metadata() if users is not None else {"privacy_unit": "sample"}
        self.sample_rate, self.noise_multiplier = sample_rate, float(noise_multiplier)
        self.max_grad_norm, self.clipping, self.loss_reduction = (
            float(g["max_grad_norm"]),
            g["clipping"],
            g["loss_reduction"],
        )
        self.noise_seed, self.sample_seed = g["noise_seed"], g["sample_seed"]
        self.memory_budget = check_budget(g["memory_budget"])
        self.autotune = check_autotune(g["autotune"])
        self.expected_batch_size = sample_rate * (users.population if users is not None else n)  # q · N, all ranks

    def _link(self, module: nn.Module) -> None:
        """The engine's weak reference and spending link on the model (and the model PEFT wraps)."""
        from ..integrations.peft_layers import wrapped_model  # peft_layers imports privacy

        if self.target_delta is not None:  # the run's δ, for a record written from the links alone (a PEFT adapter's)
            self.accountant.dpzoo_delta = float(self.target_delta)
        for m in (module, wrapped_model(module)[1]):  # a PEFT model's merge_and_unload() keeps the record
            m._dpzoo_engine = LiveRef(self)
            link_spending(m, self.accountant)  # outlives this engine, travels with copies and save_pretrained

    def _attach(self, module: nn.Module, optimizer: torch.optim.Optimizer, mode: str, train_head, signal) -> None:
        """The norm hooks in ``mode`` and the DPOptimizer around ``optimizer``; if either fails, the
        model is left as it was (no hooks, its ``requires_grad`` flags restored)."""
        requires = {p: p.requires_grad for p in module.parameters()}
        self.module = module
        self.public_statistics = stated_assumptions(module)  # what the user stated, outside ε
        try:
            notify_noise(
                module,
                noise_multiplier=self.noise_multiplier,
                max_grad_norm=self.max_grad_norm,
                expected_batch_size=self.expected_batch_size,
            )
            self._set_mode(mode, train_head)
            self.optimizer = DPOptimizer(
                optimizer,
                hooks=self.hooks,
                noise_multiplier=self.noise_multiplier,
                max_grad_norm=self.max_grad_norm,
                clipping=self.clipping,
                loss_reduction=self.loss_reduction,
                expected_batch_size=self.expected_batch_size,
                sample_rate=self.sample_rate,
                accountant=self.accountant,
                signal=signal,
                noise_seed=self.noise_seed,
            )
        except BaseException:
            if self.hooks is not None:
                self.hooks.detach()
            self.hooks, self.module = None, None
            for p, r in requires.items():
                p.requires_grad_(r)
            raise

    def _set_mode(self, mode: str, train_head) -> None:
        """Attach the norm hooks of ``mode`` (replacing any), first freezing everything outside the
        mode's trainable set (``"bitfit"``, ``"lora"``) unless ``train_head="keep"``; the optimizer
        follows them."""
        if train_head != "keep":
            apply_mode(mode, self.module, train_head)
        if self.hooks is not None:
            self.hooks.detach()
        self.hooks = attach_norm_hooks(
            self.module, MODES[mode], ghost_backward=True, memory_budget=self.memory_budget, autotune=self.autotune
        )
        self._attach_labels_loss()
        self.mode = mode
        if self.optimizer is not None:
            self.optimizer.hooks = self.hooks

    def _attach_labels_loss(self) -> None:
        """(Re-)register the model-call hooks (:mod:`.model_call`): their pre-hooks before every
        other (the watch's self-check input capture included), the loss hook after the norm
        hooks' output wrap."""
        for handle in self._call_hooks:
            handle.remove()
        self._call_hooks = attach_call_hooks(self.module, self.loss_reduction)

    def switch_mode(self, mode: str, train_head: Iterable[str] | str | None = "auto") -> None:
        """Change the algorithm mid-training, e.g. ``"bitfit"`` after X epochs of full DP
        fine-tuning (two-phase X+BiTFiT, DP-BiTFiT App. A.2.2). Accounting continues."""
        if self.module is None:
            raise DPZooError("make_private first.")
        if self.hooks is None:
            raise PrivacyUsageError("This engine was detached; make the model private again with a new engine.")
        if mode not in MODES:
            raise DPZooError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if self.optimizer.hooks.step_ready or self.optimizer.micro_batches_in_step or self.hooks.forward_calls:
            raise PrivacyUsageError("switch_mode in the middle of a logical step: call optimizer.step() first.")
        self._set_mode(mode, train_head)
        check_step_parameters(self.module, self.hooks, self.optimizer)

    def plan(self) -> list[dict]:
        """The norm hooks' plan for the current step: per use of each trainable parameter, ghost
        norm or instantiation, why, and both paths' estimated cost and memory
        (:meth:`dpzoo.grad_norms.NormHooks.plan`)."""
        if self.hooks is None:
            raise PrivacyUsageError("No hooks: make_private first (or this engine was detached).")
        return self.hooks.plan()

    def detach(self) -> None:
        """Remove the hooks (the model is an ordinary model again)."""
        if self.hooks is not None:
            self.hooks.detach()
            self.hooks = None
        for handle in self._call_hooks:
            handle.remove()
        if self._watch is not None:
            self._watch.remove()

    # -- accounting ----------------------------------------------------------------------------
    def get_epsilon(self, delta: float | None = None) -> float:
        delta = delta if delta is not None else self.target_delta
        if delta is None:
            raise DPZooError("get_epsilon needs delta (no target_delta was given to make_private).")
        check_delta(delta, self.dataset_size, self.accept_large_delta)
        return self.accountant.get_epsilon(delta)

    @property
    def steps(self) -> int:
        return self.accountant.steps

    @property
    def watch_self_check(self) -> bool:
        """Whether the first-step self-check is on (``self_check`` of make_private)."""
        return self._watch is not None and self._watch.self_check

    def privacy_metadata(self, delta: float | None = None) -> dict[str, Any]:
        """What ``dpzoo.save`` records: ε, δ, accountant, steps, sample rate, σ, R, and the accountant's
        whole (σ, q, steps) history (e.g. a release before training, composed into ε)."""
        return engine_record(self, delta if delta is not None else self.target_delta)

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
            "unknown_origin": bool(self.module is not None and unknown_origin_note(self.module)),
        }

    def load_state_dict(self, state: dict) -> None:
        restore_history(self.accountant, {"accountant": state["accountant"]})  # composed after what it holds
        if state.get("unknown_origin") and self.module is not None:  # the weights it restores hold such weights
            mark_weights_unknown(self.module)
        if self.optimizer is not None and state.get("optimizer"):
            self.optimizer.load_state_dict(state["optimizer"])
        if state.get("mode") and state["mode"] != self.mode and self.module is not None:
            self.switch_mode(state["mode"], "auto")  # refused on a detached engine (its watch is gone)
