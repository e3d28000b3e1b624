"""``DPTrainer``: a Hugging Face ``transformers.Trainer`` whose training run is differentially
private, through dpzoo's engine (:class:`dpzoo.PrivacyEngine`).

    from transformers import TrainingArguments
    from dpzoo.integrations.transformers import DPArguments, DPTrainer

    args = TrainingArguments("out", per_device_train_batch_size=32, gradient_accumulation_steps=4,
                             num_train_epochs=3, learning_rate=5e-4, eval_strategy="steps")
    trainer = DPTrainer(model, args, train_dataset=train, eval_dataset=valid, processing_class=tok,
                        privacy=DPArguments(target_epsilon=8, target_delta=1e-5, per_sample_max_grad_norm=1.0))
    trainer.train()               # log_history entries carry "epsilon" beside "loss"
    trainer.save_model()          # + dpzoo_privacy.json (and dpzoo.save's files for a dpzoo model)

How the Trainer's run maps onto DP-SGD (Abadi et al. 2016, Alg. 1, with Poisson sampling):

- the logical batch, one noise draw and one optimizer step, is Poisson-sampled with expected size
  L = ``per_device_train_batch_size × gradient_accumulation_steps``: q = L / N. The Trainer's k =
  ``gradient_accumulation_steps`` micro-steps are k chunks of that one batch, and each chunk is
  cut into forward passes of at most ``max_physical_batch_size`` rows (default
  ``per_device_train_batch_size``), whose clipped sums the engine accumulates
  (:mod:`~dpzoo.integrations.trainer_data`). So the Trainer steps, and counts a step, exactly once
  per logical batch, empty batches (noise-only steps) included, and σ is calibrated for the
  Trainer's own step count (``max_steps``, or ⌈``num_train_epochs`` × round(N/L)⌉);
- the loss is one loss per sample (:meth:`DPTrainer.per_sample_loss`, from the logits:
  :mod:`~dpzoo.integrations.trainer_loss`); its mean over each forward pass is backpropagated
  (the engine's ``loss_reduction="mean"``) and the noisy clipped sum is divided by L, as in Opacus;
- settings under which ε would be false are refused (:mod:`~dpzoo.integrations.trainer_arguments`).
  ``TrainingArguments.max_grad_norm`` has no effect: no non-private gradient exists to clip
  (the engine writes ``.grad`` inside ``optimizer.step()``); R is ``per_sample_max_grad_norm``.

Evaluation is the Trainer's, with the model's own loss. ``save_model`` (and each checkpoint) adds
the privacy metadata (:mod:`~dpzoo.integrations.trainer_save`); a checkpoint's optimizer state
carries the accountant, so ``train(resume_from_checkpoint=...)`` continues ε.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import Trainer

from ..errors import DPZooError, MissingDependencyError, PrivacyUsageError
from ..privacy import DPOptimizer, PoissonBatchSampler, PrivacyEngine, get_noise_multiplier
from ..privacy.budget import compute_sample_rate
from ..privacy.carried import prior_spending, refuse_uncounted_spending
from ..privacy.engine import engine_of
from ..privacy.modes import apply_mode
from .peft_adapters import mark_resumed
from .trainer_arguments import DPArguments, check_batch_fits, check_trainer_settings, total_steps
from .trainer_data import (
    FetchCollate,
    IndexDataset,
    PoissonTrainLoader,
    batch_rows,
    micro_batches,
    user_column,
    user_population,
)
from .trainer_loss import loss_kind, per_sample_losses
from .trainer_save import PRIVACY_FILE, read_privacy_metadata, recorded_origin, write_privacy_files

__all__ = ["DPTrainer", "DPArguments", "read_privacy_metadata", "PRIVACY_FILE"]


def _to_device(data, device):
    if isinstance(data, Mapping):
        return {k: _to_device(v, device) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(_to_device(v, device) for v in data)
    return data.to(device) if isinstance(data, torch.Tensor) else data


def _plain_optimizer(optimizer):
    """The torch optimizer under a DPOptimizer and accelerate's AcceleratedOptimizer (a second
    ``train()`` call finds the first one's wrapped optimizer)."""
    from accelerate.optimizer import AcceleratedOptimizer  # the Trainer's dependency, checked at __init__

    while True:
        if isinstance(optimizer, DPOptimizer):
            optimizer = optimizer.original_optimizer
        elif isinstance(optimizer, AcceleratedOptimizer):
            optimizer = optimizer.optimizer
        else:
            return optimizer


class DPTrainer(Trainer):
    """A :class:`transformers.Trainer` that trains with DP-SGD (see the module docstring).

    Takes the Trainer's arguments, plus ``privacy`` (:class:`DPArguments`). After
    :meth:`train`, :attr:`privacy_engine` is the :class:`dpzoo.PrivacyEngine` of the run, and
    :meth:`get_epsilon` / :meth:`privacy_metadata` report its spending.
    """

    def __init__(self, model=None, args=None, *trainer_args, privacy: DPArguments | None = None, **kwargs):
        if importlib.util.find_spec("accelerate") is None:
            raise MissingDependencyError(
                "The Hugging Face Trainer needs accelerate: pip install 'dpzoo[trainer]' (or pip install accelerate)."
            )
        if not isinstance(privacy, DPArguments):
            raise PrivacyUsageError(
                "DPTrainer needs privacy=DPArguments(target_epsilon=... or noise_multiplier=..., target_delta=...)."
            )
        super().__init__(model, args, *trainer_args, **kwargs)
        self.privacy = privacy
        self.privacy_engine: PrivacyEngine | None = None
        self._logged_epsilon: tuple = (None, None)  # (the accountant's history, its ε) last logged
        check_trainer_settings(self, DPTrainer)

    # -- the private data and optimizer --------------------------------------------------------
    def get_train_dataloader(self) -> Any:
        """The engine's Poisson batches, ``gradient_accumulation_steps`` chunks each. Makes the model
        and the optimizer private on the way (a new :class:`~dpzoo.PrivacyEngine`, composed after
        any privacy the model already spent)."""
        check_trainer_settings(self, DPTrainer)
        base = super().get_train_dataloader()  # the Trainer's dataset (unused columns removed) and collator
        dataset, collate = base.dataset, base.collate_fn
        n = len(dataset)
        chunks = self.args.gradient_accumulation_steps
        logical = self.args.per_device_train_batch_size * chunks  # with a user column: users per step (ULS)
        p, model = self.privacy, self.model
        users = user_column(self.train_dataset, p, self.args.per_device_train_batch_size)
        population = n if users is None else user_population(users, p.max_examples_per_user, p.user_sampling)
        check_batch_fits(logical, population)
        earlier = engine_of(model)
        if earlier is not None and earlier.module is model:  # not the engine of a model this one is a copy of
            earlier.detach()  # an earlier run on this model (e.g. a second train()): its spending composes
        if self.optimizer is None:  # the Trainer builds it from what requires grad: the mode's set first
            apply_mode(p.mode, model, p.train_head)
            self.create_optimizer()
        optimizer = _plain_optimizer(self.optimizer)
        sigma = p.noise_multiplier
        q = compute_sample_rate(logical, 1, population)
        steps_per_epoch = len(PoissonBatchSampler(population, q))  # the engine loader's logical batches per epoch
        group = p.max_examples_per_user if users is not None and p.user_sampling == "examples" else 1
        if p.target_epsilon is not None:  # calibrated for the steps the Trainer will take
            steps = total_steps(self.args, steps_per_epoch)
            prior = prior_spending(model, earlier.accountant if earlier is not None else None)
            sigma = get_noise_multiplier(
                p.target_epsilon, p.target_delta, q, steps, p.accountant, history=prior, group=group
            )
        engine = PrivacyEngine(accountant=p.accountant)
        index_loader = DataLoader(
            IndexDataset(n),
            batch_size=logical,
            collate_fn=FetchCollate(dataset, collate, drop=p.user_column),
            num_workers=self.args.dataloader_num_workers,
        )
        _, dp_optimizer, dp_loader = engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=index_loader,
            noise_multiplier=sigma,
            target_delta=p.target_delta,
            max_grad_norm=p.per_sample_max_grad_norm,
            clipping=p.clipping,
            mode=p.mode,
            loss_reduction="mean",
            train_head=p.train_head,
            noise_seed=p.noise_seed,
            sample_seed=p.sample_seed,
            self_check=p.self_check,
            accept_large_delta=p.accept_large_delta,
            privacy_unit="sample" if users is None else "user",
            user_ids=users,
            max_examples_per_user=None if users is None else p.max_examples_per_user,
            user_sampling=p.user_sampling,
        )
        if len(dp_loader) != steps_per_epoch or engine.sample_rate != q:
            engine.detach()
            raise PrivacyUsageError(
                f"The engine's loader has {len(dp_loader)} batches per epoch at q = {engine.sample_rate}, σ was "
                f"calibrated for {steps_per_epoch} at q = {q}: dpzoo's Trainer integration and engine disagree."
            )
        # An empty Poisson batch reaches the Trainer as empty chunks, so that the Trainer takes (and
        # counts, and schedules) its noise-only step, instead of the engine taking it unseen.
        dp_loader.signal.on_empty = None
        self.optimizer, self.privacy_engine = dp_optimizer, engine
        self._train_loader = PoissonTrainLoader(dp_loader, chunks)
        return self._train_loader

    # -- one accumulation micro-step: a chunk of the logical batch ----------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """Forward and backward passes over ``inputs`` (a chunk of the logical batch) in micro-batches
        of at most ``max_physical_batch_size`` rows, each backpropagating the mean of its per-sample
        losses (the engine clips each sample and accumulates). Returns the chunk's share of the
        logical batch's mean loss, for logging (0 for an empty batch)."""
        engine = self.privacy_engine
        if engine is None or engine.optimizer is None:
            raise PrivacyUsageError("DPTrainer.training_step runs inside DPTrainer.train() only.")
        model.train()
        total = torch.zeros((), device=self.args.device)
        size = self.privacy.max_physical_batch_size or self.args.per_device_train_batch_size
        loader = getattr(self, "_train_loader", None)
        groups = loader.chunk_groups.popleft() if loader is not None and loader.chunk_groups else None
        for micro, users in micro_batches(inputs, size, groups):
            engine.optimizer.signal.groups = users  # read at the micro-batch's first forward: its rows' users
            micro = _to_device(micro, self.args.device)
            rows = batch_rows(micro)
            with self.compute_loss_context_manager():
                losses = self.per_sample_loss(model, micro)
            if not isinstance(losses, torch.Tensor) or tuple(losses.shape) != (rows,):
                shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
                raise PrivacyUsageError(
                    f"per_sample_loss must return one loss per sample, Tensor[{rows}], got {shape}: reduce each "
                    "sample's loss over its own tokens only, never over the batch."
                )
            losses.mean().backward()
            total = total + losses.detach().sum()
        return total / max(engine.optimizer.signal.logical_batch_size, 1)

    def per_sample_loss(self, model, inputs: dict) -> torch.Tensor:
        """Tensor[B]: the loss of each row of ``inputs``, depending on that row only.

        Default: the model's logits against ``inputs["labels"]`` (causal LMs shifted, tokens reduced
        per sample by ``DPArguments.token_reduction``, classification by ``config.problem_type``;
        :mod:`~dpzoo.integrations.trainer_loss`). Override it for another loss; ``compute_loss``
        is then left to evaluation."""
        if list(self.label_names) != ["labels"] or "labels" not in inputs:
            raise PrivacyUsageError(
                f"The batch has no 'labels' (label_names={list(self.label_names)}): DPTrainer's default per-sample "
                "loss needs them; subclass DPTrainer and override per_sample_loss(model, inputs)."
            )
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        unwrapped = self.accelerator.unwrap_model(model)
        config = getattr(unwrapped, "config", None)
        if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" not in inputs:
            inputs["labels"] = labels  # the model builds its decoder inputs from them; its batch loss is unused
        outputs = model(**inputs)
        return per_sample_losses(
            outputs,
            labels,
            kind=loss_kind(unwrapped),
            token_reduction=self.privacy.token_reduction,
            label_smoothing=float(self.args.label_smoothing_factor or 0.0),
            problem_type=getattr(config, "problem_type", None),
            num_labels=getattr(config, "num_labels", None),
        )

    # -- what the run spent --------------------------------------------------------------------
    def get_epsilon(self, delta: float | None = None) -> float:
        """ε spent so far (every step of this run, after what the model spent before), at ``delta``
        (default: ``DPArguments.target_delta``)."""
        if self.privacy_engine is None:
            raise PrivacyUsageError("No private training has run yet: call train() first.")
        return self.privacy_engine.get_epsilon(delta)

    def privacy_metadata(self) -> dict[str, Any] | None:
        """What ``save_model`` records: the engine's metadata once a step was taken, else what the
        model already carried (``model.dpzoo_privacy``, or the record of the directory it was
        reloaded from), else None."""
        engine = self.privacy_engine
        if engine is not None and engine.steps > 0:
            return engine.privacy_metadata()
        carried = getattr(self.model, "dpzoo_privacy", None)
        if carried is None:
            found = recorded_origin(self.model)
            carried = found[0] if found and found[1] != "the model's config" else None  # a full record only
        try:  # a record that leaves out what the model spent since (a later run) is not written
            refuse_uncounted_spending(self.model, carried)
        except DPZooError:
            return None  # config.json's live record still says all of it
        return carried

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's logging, with ``logs["epsilon"]`` on training logs (so callbacks and
        ``state.log_history`` see it). The Trainer's ``grad_norm`` is dropped: it measures no
        gradient (the private one exists only inside ``optimizer.step()``)."""
        engine = self.privacy_engine
        if engine is not None and ("loss" in logs or "train_loss" in logs):
            spent = (engine.accountant.name, str(engine.accountant.history))
            if self._logged_epsilon[0] != spent:  # the accountant's libraries are not free: once per history
                self._logged_epsilon = (spent, engine.get_epsilon())
            logs["epsilon"] = self._logged_epsilon[1]
            logs.pop("grad_norm", None)
        super().log(logs, start_time)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """The Trainer's resume, plus: the weights it restored are this run's own (a LoRA adapter
        restored from the checkpoint is not one of unknown origin), since the checkpoint's
        optimizer state restores their spending (refused when the checkpoint has none)."""
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        record = read_privacy_metadata(resume_from_checkpoint)
        if record and record.get("steps"):
            if not os.path.isfile(os.path.join(resume_from_checkpoint, "optimizer.pt")):
                raise PrivacyUsageError(
                    f"{resume_from_checkpoint} holds DP-trained weights but no optimizer state, which carries their "
                    "spending: resume from a checkpoint saved with its optimizer (save_only_model=False)."
                )
            mark_resumed(self.model, str(resume_from_checkpoint))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The Trainer's ``save_model``, plus the privacy metadata (``dpzoo_privacy.json``; for a
        dpzoo model also :func:`dpzoo.save`'s files). Pushed to the Hub after the metadata."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        super().save_model(output_dir, _internal_call=True)
        if self.args.should_save:
            write_privacy_files(self.model, output_dir, self.privacy_metadata(), zoo_files=not _internal_call)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def create_model_card(self, *args, **kwargs) -> None:
        """The Trainer's model card (``push_to_hub`` writes it after ``save_model``), then dpzoo's
        privacy card over it again: ``README.md`` beside a privacy record must state that record."""
        super().create_model_card(*args, **kwargs)
        if self.args.should_save and (Path(self.args.output_dir) / PRIVACY_FILE).exists():
            write_privacy_files(self.model, self.args.output_dir, self.privacy_metadata(), zoo_files=False)
