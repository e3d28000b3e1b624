"""Where a training run writes, as it goes: the output directory, metrics.csv, TensorBoard, checkpoint files.

``dpzoo train`` checks its output directory before it trains (a non-empty one is refused unless
``overwrite``; an unwritable one is refused), so a long run never ends with its results
refused. Each evaluation is appended to ``metrics.csv`` at once (header once) and, when the
``tensorboard`` package is installed, to TensorBoard event files under ``tensorboard/``; a
resumed run rewrites ``metrics.csv`` from its checkpoint's history, so rows from after the
checkpoint are not repeated. Checkpoint files are replaced atomically (written beside, then
renamed), so an interruption while saving leaves the previous checkpoint intact.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, SaveError

__all__ = [
    "RUN_OUTPUTS",
    "CHECKPOINT_NAME",
    "prepare_out_dir",
    "no_empty_out_left",
    "writable_dir",
    "MetricsLog",
    "write_json",
    "save_checkpoint",
    "load_checkpoint",
    "checkpoint_path",
    "compare_settings",
    "open_run",
]

CHECKPOINT_NAME = "checkpoint.pt"
# what a run writes into its output directory (``overwrite`` removes these, nothing else)
RUN_OUTPUTS = ("model", "metrics.json", "metrics.csv", "metrics.png", CHECKPOINT_NAME, "tensorboard")
CHECKPOINT_FORMAT = "dpzoo-training-checkpoint"


@contextmanager
def no_empty_out_left(out: str | Path | None):
    """A run refused before it wrote anything (bad data, δ, batch size) leaves no empty ``out``
    behind when ``out`` did not exist before it."""
    fresh = out is not None and not Path(out).exists()
    try:
        yield
    except BaseException:
        if fresh and Path(out).is_dir() and not any(Path(out).iterdir()):
            Path(out).rmdir()
        raise


def prepare_out_dir(out: str | Path, *, overwrite: bool = False, resume: bool = False) -> Path:
    """Create ``out`` (parents too) and check it can be written, before any training.

    A directory that already holds files is refused (its results would be overwritten or mixed
    with this run's) unless ``overwrite`` (dpzoo's own outputs in it are removed first: the
    model, metrics, checkpoint and TensorBoard files; other files are left alone) or ``resume``
    (the run in it continues)."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise SaveError(f"--out {path} is a file, not a directory: choose a directory for the run's results.")
    if path.is_dir() and not resume:
        present = sorted(p.name for p in path.iterdir())
        if present and not overwrite:
            shown = ", ".join(present[:4]) + (", ..." if len(present) > 4 else "")
            hint = f" or --resume {path} to continue its run" if CHECKPOINT_NAME in present else ""
            raise SaveError(
                f"--out {path} is not empty ({shown}): choose a new directory, or pass --overwrite to replace "
                f"dpzoo's results in it{hint}."
            )
        for name in RUN_OUTPUTS:
            old = path / name
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old)
            elif old.exists() or old.is_symlink():
                old.unlink()
    return writable_dir(path)


def writable_dir(out: str | Path) -> Path:
    """Create ``out`` (parents too) and check that a file can be written in it."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise SaveError(f"--out {path} is a file, not a directory: choose a directory for the results.")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise SaveError(
            f"--out {path} cannot be written ({e.strerror or e}): choose a directory you can write to."
        ) from None
    return path


def write_json(path: Path, payload: Any) -> None:
    path.write_text(json.dumps(payload, indent=2) + "\n")


class MetricsLog:
    """One row per evaluation, written as it comes: ``metrics.csv`` (append, header once) and
    TensorBoard scalars (``tensorboard/``, when the package is installed), x-axis = the step.

    ``history``: the rows a resumed run already has (the CSV is rewritten with exactly these, and
    TensorBoard events after ``resume_step`` are discarded). With ``out=None`` nothing is written."""

    def __init__(self, out: Path | None, history: list[dict] | None = None, resume_step: int | None = None):
        self.csv_path = out / "metrics.csv" if out is not None else None
        self.columns: list[str] | None = None
        self.writer = None
        self.tensorboard = False
        if out is None:
            return
        rows = history or []
        if rows:
            self.columns = list(rows[0])
            with self.csv_path.open("w", newline="") as f:
                w = csv.DictWriter(f, self.columns, extrasaction="ignore")
                w.writeheader()
                w.writerows(rows)
        elif self.csv_path.exists():
            self.csv_path.unlink()  # a resumed run that had not evaluated yet
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # optional: pip install dpzoo[tensorboard]
            return
        purge = resume_step + 1 if resume_step is not None else None
        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"), purge_step=purge)
        self.tensorboard = True

    def append(self, row: dict) -> None:
        if self.csv_path is None:
            return
        new = self.columns is None
        if new:
            self.columns = list(row)
        with self.csv_path.open("a", newline="") as f:
            w = csv.DictWriter(f, self.columns, extrasaction="ignore")
            if new:
                w.writeheader()
            w.writerow(row)
        if self.writer is not None:
            step = int(row.get("step", 0))
            for key, value in row.items():
                if key not in ("step", "epoch") and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(key, value, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def checkpoint_path(where: str | Path) -> Path:
    """The checkpoint file of a run directory (or the file itself); refused if there is none."""
    path = Path(where)
    file = path / CHECKPOINT_NAME if path.is_dir() else path
    if not file.is_file():
        raise CheckpointError(
            f"No training checkpoint at {file}: --resume takes the --out directory of an interrupted "
            "`dpzoo train` run (it holds checkpoint.pt)."
        )
    return file


def save_checkpoint(path: Path, state: dict) -> None:
    """Write ``state`` to ``path`` atomically (a partial file never replaces a good one)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        torch.save({"format": CHECKPOINT_FORMAT, "version": 1, **state}, tmp)
        os.replace(tmp, path)
    except Exception as e:  # a full disk: torch raises RuntimeError ("PytorchStreamWriter failed ..."), not OSError
        tmp.unlink(missing_ok=True)
        kept = "the previous checkpoint is kept" if path.exists() else "no checkpoint was written"
        raise CheckpointError(
            f"Could not write the checkpoint {path} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
            f"{kept}. Free disk space, or pass --checkpoint-every off."
        ) from e


def load_checkpoint(where: str | Path, *, mmap: bool = False) -> dict:
    """Read a checkpoint written by :func:`save_checkpoint` (tensors and plain values only:
    ``weights_only`` loading runs no code from the file). ``mmap=True`` reads tensors only when
    used (to look at the settings of a large checkpoint)."""
    file = checkpoint_path(where)
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # a truncated or foreign file: torch raises many kinds
        raise CheckpointError(f"{file} is not a readable dpzoo training checkpoint ({type(e).__name__}: {e}).") from e
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{file} is not a dpzoo training checkpoint (written by `dpzoo train --out`).")
    return state


def compare_settings(saved: dict, settings: dict) -> None:
    """Refuse to resume with settings other than the checkpoint's (σ, q, the schedule and the
    target ε were fixed for them)."""
    differ = [k for k in sorted(set(saved) | set(settings)) if saved.get(k) != settings.get(k)]
    if differ:
        shown = "; ".join(f"{k}: checkpoint {saved.get(k)!r}, now {settings.get(k)!r}" for k in differ[:4])
        raise CheckpointError(
            f"The checkpoint was made with other settings ({shown}): resume with the settings the run started "
            "with (`dpzoo train --resume DIR` takes them from the checkpoint)."
        )


def open_run(
    out: str | Path | None, settings: dict, *, resume: str | Path | None = None, overwrite: bool = False
) -> tuple[Path | None, dict | None]:
    """The checked output directory of a run (None without ``out``) and the checkpoint it resumes
    from (None for a new run). A resumed run writes into the checkpoint's directory unless ``out``
    names another (which must then be new or empty, as for a new run)."""
    checkpoint, same = None, False
    if resume is not None:
        file = checkpoint_path(resume)
        checkpoint = load_checkpoint(file)
        compare_settings(checkpoint["settings"], settings)
        out = file.parent if out is None else out
        same = Path(out).resolve() == file.parent.resolve()
    run_dir = prepare_out_dir(out, overwrite=overwrite, resume=same) if out is not None else None
    return run_dir, checkpoint
