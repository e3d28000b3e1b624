"""One ``dpzoo train`` run from start to finish, for every kind of model.

:class:`TrainingRun` is the skeleton: it refuses what cannot work before anything is read, opens
the output directory (a new run, or a resumed one whose settings must be the checkpoint's),
builds the data and model, makes the optimizer private once (σ calibrated to the target ε for a
new run, the checkpoint's σ for a resumed one: calibrated once, for the whole run), drives
:class:`~dpzoo.runs.loop.TrainingLoop` (steps, evaluations, checkpoints, Ctrl-C) and writes a
finished run's files: metrics.json before the model (a failed save keeps the metrics), the plot,
and the model with its privacy metadata. What differs between models (data, model, loss,
evaluation, the result's fields) is a subclass's: :class:`dpzoo.runs.classifier.ClassifierRun`
for image, tabular and text classifiers, :class:`dpzoo.seqrec.train.SeqrecRun` for sequence
models.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ..hub.load_save import save
from ..privacy import PrivacyEngine
from .files import open_run, write_json
from .loop import TrainingLoop, resolve_device
from .plots import plot_metrics

__all__ = ["TrainingRun"]


class TrainingRun:
    """A run of the training function whose ``arguments`` (by name) it holds as ``self.o``.

    A subclass builds the data and model (:meth:`build`, which also sets ``self.delta`` and
    ``self.batch_size``), and says what the optimizer, loss, evaluation, result and files are."""

    def __init__(self, arguments: dict[str, Any]):
        self.o = SimpleNamespace(**arguments)
        self.settings = self.make_settings()
        self.delta: float | None = getattr(self.o, "delta", None)
        self.batch_size: int = getattr(self.o, "batch_size", 0)

    # -- what each kind of run says -------------------------------------------------------------

    def make_settings(self) -> dict:
        """The run's settings: saved in checkpoints, and a resume must give the same."""
        raise NotImplementedError

    def check(self) -> None:
        """Refuse arguments that cannot work, before anything is read or written."""

    def build(self, device: torch.device, checkpoint: dict | None) -> tuple[nn.Module, Dataset]:
        """(the model on ``device``, in training mode; the training set)."""
        raise NotImplementedError

    def new_engine(self, checkpoint: dict | None) -> PrivacyEngine | None:
        """The engine (None: the non-private reference run)."""
        return PrivacyEngine(accountant=self.o.accountant)

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        raise NotImplementedError

    def engine_options(self, model: nn.Module, device: torch.device) -> dict:
        """``make_private`` arguments beyond the run's common ones."""
        return {}

    def non_private_loader(self, train_set: Dataset) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no non-private runs")

    def scheduler(self, optimizer: Any, engine: PrivacyEngine | None, total_steps: int) -> Any:
        """The learning-rate schedule, stepped after every logical step (None: constant)."""
        return None

    def first_line(self, engine: PrivacyEngine | None, loop: TrainingLoop, resumed: bool) -> str:
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: Any, device: torch.device) -> torch.Tensor:
        raise NotImplementedError

    def evaluate(self, model: nn.Module, device: torch.device) -> dict:
        raise NotImplementedError

    def describe(self, row: dict) -> str:
        """One evaluation, as a line of the log."""
        raise NotImplementedError

    def result(self, engine: PrivacyEngine | None, loop: TrainingLoop, history: list, device: torch.device) -> dict:
        """metrics.json's content (also what the training function returns)."""
        raise NotImplementedError

    def plot(self) -> tuple[str, list, dict]:
        """(title, series, plot_metrics options) of metrics.png."""
        raise NotImplementedError

    def privacy_metadata(self, engine: PrivacyEngine, model: nn.Module) -> dict:
        return engine.privacy_metadata(self.delta)

    def datasets(self) -> list[str] | None:
        """The datasets named on the model card (a user's path stays off it)."""
        return None

    def saved_model(self, model: nn.Module) -> nn.Module:
        return model

    def save_extras(self, run_dir: Path) -> None:
        """Files beside the saved model (a tokenizer)."""

    # -- the skeleton ---------------------------------------------------------------------------

    def run(self) -> dict:
        o = self.o
        self.check()  # the run's own arguments, and check_loop_arguments where the run checked them before
        device = resolve_device(o.device)
        run_dir, checkpoint = open_run(o.out, self.settings, resume=o.resume, overwrite=o.overwrite)
        torch.manual_seed(o.seed)
        model, train_set = self.build(device, checkpoint)
        optimizer = self.optimizer(model)  # before the engine: an unknown optimizer is the first error
        engine = self.new_engine(checkpoint)
        model, optimizer, loader = self.make_private(engine, model, optimizer, train_set, checkpoint, device)
        loop = TrainingLoop(
            name=o.name,
            model=model,
            optimizer=optimizer,
            loader=loader,
            epochs=o.epochs,
            settings=self.settings,
            engine=engine,
            delta=self.delta,
            scheduler=self.scheduler(optimizer, engine, o.epochs * len(loader)),
            out=run_dir,
            checkpoint_every=o.checkpoint_every,
            progress=o.progress,
            step_callback=o.step_callback,
            log=o.log,
            handle_sigint=o.handle_sigint,
        )
        if checkpoint is not None:
            loop.load_state_dict(checkpoint)
        o.log(self.first_line(engine, loop, checkpoint is not None))

        def train_step(batch):
            loss = self.loss(model, batch, device)
            loss.backward()
            return loss

        history = loop.run(
            train_step, lambda: self.evaluate(model, device), eval_every=o.eval_every, describe=self.describe
        )
        result = self.result(engine, loop, history, device)
        if run_dir is not None:
            self.finish(run_dir, model, engine, result)
        return result

    def make_private(self, engine, model, optimizer, train_set, checkpoint, device):
        """(model, optimizer, loader): private through ``engine``, or plain without one."""
        o = self.o
        if engine is None:
            return model, optimizer, self.non_private_loader(train_set)
        options = self.engine_options(model, device)
        noise = (
            {"target_epsilon": o.epsilon}
            if checkpoint is None
            else {"noise_multiplier": checkpoint["engine"]["noise_multiplier"]}  # σ of the whole run, kept
        )
        return engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=DataLoader(train_set, batch_size=self.batch_size),
            target_delta=self.delta,
            epochs=o.epochs,
            max_grad_norm=o.max_grad_norm,
            clipping=o.clipping,
            mode=o.mode,
            noise_seed=o.noise_seed,
            sample_seed=o.sample_seed,
            **options,
            **noise,
        )

    def finish(self, run_dir: Path, model: nn.Module, engine: PrivacyEngine | None, result: dict) -> None:
        if engine is not None:
            engine.detach()
        write_json(run_dir / "metrics.json", result)  # before the model: a failed save keeps the metrics
        privacy = self.privacy_metadata(engine, model) if engine is not None else None
        written = ["metrics.csv", "metrics.json"]
        title, series, options = self.plot()
        if plot_metrics(result["history"], run_dir / "metrics.png", title, series, **options):
            written.append("metrics.png")
        if (run_dir / "tensorboard").is_dir():
            written.append("tensorboard/")
        save(self.saved_model(model), run_dir / "model", privacy=privacy, datasets=self.datasets())
        self.save_extras(run_dir)
        self.o.log(
            f"saved the model{' (with its privacy metadata)' if privacy else ''}, {', '.join(written)} to {run_dir}"
        )
