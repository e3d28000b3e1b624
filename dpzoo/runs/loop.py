"""Driving a training run step by step: progress bar, evaluations, checkpoints, Ctrl-C and resume.

:class:`TrainingLoop` runs the epochs of ``dpzoo train`` (images and sequences alike) around a
``train_step(batch) -> loss`` (forward and backward) and an ``evaluate() -> dict``:

* a per-step progress bar (tqdm) with the last batch's loss, the ε spent so far, the seconds per
  step and the micro-batches per step when physical batching splits them, hidden when
  stderr is not a terminal (``progress=None``) or with ``progress=False``. The loss is that of
  private training data: it is shown on the terminal only, never written to a file;
* an evaluation every ``eval_every`` epochs and after the last, appended at once to
  ``metrics.csv`` and TensorBoard (:class:`dpzoo.runs.files.MetricsLog`);
* a checkpoint (model, optimizer, the engine's state with the accountant's history, LR
  schedule, progress, RNG states) after every epoch or every N steps, replaced atomically;
* on Ctrl-C a checkpoint at the last completed step and a message saying how to resume. With
  ``handle_sigint`` (the command line) the first Ctrl-C lets the current step finish, so the
  checkpoint is exactly the state after a step; a second one stops at once.

Steps are logical steps of the mechanism: for private training the DP optimizer's count
(``DPOptimizer.steps``, which includes the engine's noise-only steps on empty Poisson batches),
so a resumed run takes exactly the steps the interrupted one had left and its ε is the one an
uninterrupted run would report. Epochs of Poisson sampling are just ``len(loader)`` steps each;
a run resumed mid-epoch draws the epoch's remaining steps.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import CheckpointError, InvalidArgumentError
from .files import CHECKPOINT_NAME, MetricsLog, save_checkpoint
from .progress import StepBar

__all__ = ["TrainingLoop", "check_loop_arguments", "resolve_device"]


def check_loop_arguments(*, epochs: int, eval_every: int, checkpoint_every: int | str) -> None:
    """Refuse loop settings that cannot work, before anything is loaded or trained."""
    for label, value in (("epochs", epochs), ("eval_every", eval_every)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(f"{label} must be a whole number >= 1, got {value!r}.")
    ok = checkpoint_every in ("epoch", "off") or (
        isinstance(checkpoint_every, int) and not isinstance(checkpoint_every, bool) and checkpoint_every >= 1
    )
    if not ok:
        raise InvalidArgumentError(
            f"checkpoint_every must be 'epoch', 'off' or a number of steps >= 1, got {checkpoint_every!r}."
        )


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch.device, refused if it is malformed or not available here."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidArgumentError(
            f"device {device!r} is not a torch device: use cpu, cuda, cuda:1, mps, ..."
        ) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError(f"device {device!r}: no CUDA device is available here (torch.cuda.is_available()).")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise InvalidArgumentError(f"device {device!r}: there are {torch.cuda.device_count()} CUDA devices.")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise InvalidArgumentError(f"device {device!r}: MPS is not available here.")
    return dev


class TrainingLoop:
    """The epochs of one training run (see the module docstring).

    ``engine`` (a :class:`~dpzoo.PrivacyEngine` that made ``optimizer`` private) or None for
    non-private training; ``delta`` is the δ at which ε is reported. ``settings``: the run's
    arguments, saved in checkpoints and compared on resume. ``step_callback(step)`` runs after
    every logical step (a KeyboardInterrupt raised there is handled as a Ctrl-C)."""

    def __init__(
        self,
        *,
        name: str,
        model: torch.nn.Module,
        optimizer: Any,
        loader: Any,
        epochs: int,
        settings: dict,
        engine: Any = None,
        delta: float | None = None,
        scheduler: Any = None,
        out: Path | None = None,
        checkpoint_every: int | str = "epoch",
        progress: bool | None = None,
        step_callback: Callable[[int], None] | None = None,
        log: Callable[[str], None] = print,
        handle_sigint: bool = False,
    ):
        self.name, self.model, self.optimizer, self.loader = name, model, optimizer, loader
        self.engine, self.delta, self.scheduler = engine, delta, scheduler
        self.private = engine is not None
        self.epochs, self.settings, self.out = epochs, settings, out
        self.checkpoint_every = checkpoint_every if out is not None else "off"
        self.progress, self.step_callback, self.log = progress, step_callback, log
        self.handle_sigint = handle_sigint
        self.steps_per_epoch = len(loader)
        self.total_steps = epochs * self.steps_per_epoch
        self.count = 0  # steps of non-private training (private: the DP optimizer counts)
        self.epochs_done = 0
        self.history: list[dict] = []
        self.seconds_before = 0.0
        self.last_loss: torch.Tensor | None = None
        self.micro_batches = 0  # forward/backward passes of the step under way (physical batches)
        self.stop_requested = False
        self.resumed_at: int | None = None
        self.pending_rng: torch.Tensor | None = None
        self._epsilon: tuple[int, float] | None = None
        self.bar: StepBar | None = None
        self._started = time.time()
        if self.private:  # after every logical step, the noise-only ones on empty batches included
            if scheduler is not None:
                optimizer.attach_step_hook(lambda _: scheduler.step())
            optimizer.attach_step_hook(lambda _: self.after_step())

    @property
    def step(self) -> int:
        return int(self.optimizer.steps) if self.private else self.count

    def epsilon(self) -> float | None:
        """ε spent so far at ``delta`` (None without DP); computed once per step."""
        if not self.private:
            return None
        if self._epsilon is None or self._epsilon[0] != self.step:
            self._epsilon = (self.step, float(self.engine.get_epsilon(self.delta)))
        return self._epsilon[1]

    @property
    def checkpoint_file(self) -> Path | None:
        return self.out / CHECKPOINT_NAME if self.out is not None else None

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state: dict[str, Any] = {
            "settings": self.settings,
            "model": self.model.state_dict(),
            "progress": {
                "step": self.step,
                "epochs_done": self.epochs_done,
                "total_steps": self.total_steps,
                "seconds": self.seconds(),
            },
            "history": self.history,
            "device": str(next(self.model.parameters()).device),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "rng": torch.get_rng_state(),
        }
        if self.private:
            gen = self.loader.batch_sampler.generator  # set only for reproducible sampling (sample_seed)
            state["engine"] = self.engine.state_dict()
            state["self_check"] = self.engine.self_check_result
            state["sample_generator"] = gen.get_state() if gen is not None else None
            state["privacy"] = {"epsilon": self.epsilon(), "delta": self.delta, "steps": self.step}
        else:
            state["optimizer"] = self.optimizer.state_dict()
        return state

    def save(self) -> Path | None:
        if self.checkpoint_file is None:
            return None
        save_checkpoint(self.checkpoint_file, self.state_dict())
        return self.checkpoint_file

    def load_state_dict(self, state: dict) -> None:
        """Continue from a checkpoint of this run (the settings are compared by the caller)."""
        progress = state["progress"]
        if progress["total_steps"] != self.total_steps:
            raise CheckpointError(
                f"The checkpoint's run has {progress['total_steps']} steps, this one {self.total_steps}: "
                "the data or the batch size changed since it was saved."
            )
        if progress["epochs_done"] >= self.epochs and (self.out is None or (self.out / "model").exists()):
            # complete; without model/ it was stopped while writing its results: they are written again
            raise CheckpointError(
                f"The run in this checkpoint is complete ({progress['step']} steps, {self.epochs} epochs"
                + (f", saved in {self.out / 'model'}" if self.out is not None else "")
                + "): nothing to resume. Start a new run in another --out directory."
            )
        self.model.load_state_dict(state["model"])
        if self.private:
            if state.get("engine") is None:
                raise CheckpointError("This checkpoint is of non-private training: it cannot continue privately.")
            saved = state["engine"]
            if not math.isclose(saved["sample_rate"], self.engine.sample_rate, rel_tol=1e-12):
                raise CheckpointError(
                    f"The checkpoint sampled at q = {saved['sample_rate']:.6g}, this run at "
                    f"q = {self.engine.sample_rate:.6g}: the data changed since it was saved."
                )
            self.engine.load_state_dict(saved)
            self.engine.self_check_result = state.get("self_check")
            gen = self.loader.batch_sampler.generator
            if gen is not None and state.get("sample_generator") is not None:
                gen.set_state(state["sample_generator"])
        else:
            self.optimizer.load_state_dict(state["optimizer"])
            self.count = progress["step"]
        if self.step != progress["step"]:
            raise CheckpointError(f"The checkpoint records {progress['step']} steps but its optimizer {self.step}.")
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        if progress["step"] != progress["epochs_done"] * self.steps_per_epoch:
            # mid-epoch: the interrupted run had its data iterator already; a new one draws a seed
            # from torch's RNG, so the state is set again once it exists (reproducible dropout)
            self.pending_rng = state["rng"]
        self.epochs_done = progress["epochs_done"]
        self.seconds_before = progress["seconds"]
        self.history = [dict(row) for row in state["history"]]
        self.resumed_at = self.step

    # -- the loop ------------------------------------------------------------------------------
    def seconds(self) -> float:
        return self.seconds_before + time.time() - self._started

    def say(self, message: str) -> None:
        if self.bar is not None:
            self.bar.say(message, self.log)
        else:
            self.log(message)

    def after_step(self) -> None:
        """After each logical step: progress, the user's callback, periodic checkpoints, a
        pending Ctrl-C."""
        if self.bar is not None:
            self.bar.step(self.last_loss, self.micro_batches)
        self.micro_batches = 0
        if self.step_callback is not None:
            self.step_callback(self.step)
        if isinstance(self.checkpoint_every, int) and self.step % self.checkpoint_every == 0:
            self.save()
        if self.stop_requested:
            raise KeyboardInterrupt

    def _batches(self, remaining: int):
        """The ``remaining`` steps of the current epoch (Poisson batches: the sampler is told how many)."""
        if remaining <= 0:
            return
        if self.private:
            sampler = self.loader.batch_sampler
            full, sampler.steps = sampler.steps, remaining
            try:
                yield from self.loader
            finally:
                sampler.steps = full
        else:
            yield from itertools.islice(self.loader, remaining)

    @contextlib.contextmanager
    def _interrupts(self):
        """With ``handle_sigint``: the first Ctrl-C stops after the current step, a second at once."""
        if not self.handle_sigint or threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.getsignal(signal.SIGINT)

        def handler(signum, frame):
            if self.stop_requested:
                signal.signal(signal.SIGINT, previous)
                raise KeyboardInterrupt
            self.stop_requested = True
            print("\ndpzoo: stopping after this step to save a checkpoint (Ctrl-C again: stop now)", file=sys.stderr)

        signal.signal(signal.SIGINT, handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def run(
        self,
        train_step: Callable[[Any], torch.Tensor | None],
        evaluate: Callable[[], dict],
        *,
        eval_every: int,
        describe: Callable[[dict], str],
    ) -> list[dict]:
        """Train to the end (or from the checkpoint loaded); returns the evaluation history."""
        metrics = MetricsLog(self.out, self.history, self.resumed_at)
        self._started = time.time()
        self.bar = StepBar(self.total_steps, self.name, enabled=self.progress, epsilon=self.epsilon, initial=self.step)
        try:
            with self._interrupts():
                for epoch in range(self.epochs_done + 1, self.epochs + 1):
                    for batch in self._batches(epoch * self.steps_per_epoch - self.step):
                        if self.pending_rng is not None:
                            torch.set_rng_state(self.pending_rng)
                            self.pending_rng = None
                        loss = train_step(batch)
                        self.micro_batches += 1
                        self.last_loss = loss.detach() if loss is not None else None
                        self.optimizer.step()  # private: after a logical step the hooks above run
                        self.optimizer.zero_grad()
                        if not self.private:
                            if self.scheduler is not None:
                                self.scheduler.step()
                            self.count += 1
                            self.after_step()
                    if epoch % eval_every == 0 or epoch == self.epochs:
                        row = {"epoch": epoch, "step": self.step, **evaluate()}
                        row.update(epsilon=self.epsilon(), seconds=self.seconds())
                        self.history.append(row)
                        metrics.append(row)
                        self.say(describe(row))
                    self.epochs_done = epoch
                    if self.checkpoint_every == "epoch":
                        self.save()
                    self.bar.restart_timing()  # an evaluation's or a checkpoint's seconds are no step's
                    if self.stop_requested:
                        raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise KeyboardInterrupt(self._interrupted()) from None
        finally:
            self.bar.close()
            metrics.close()
        return self.history

    def _interrupted(self) -> str:
        where = self.save()
        eps = self.epsilon()
        spent = f", ε = {eps:.4g} spent so far" if eps is not None else ""
        text = f"{self.name}: interrupted after step {self.step} of {self.total_steps}{spent}"
        if where is None:
            return text + "; nothing saved (no output directory)."
        return f"{text}; checkpoint saved to {where}. Continue with: dpzoo train --resume {self.out}"
