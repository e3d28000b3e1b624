"""Read checkpoints safely and load them with errors that name every bad tensor."""

from __future__ import annotations

import fnmatch
import hashlib
import os
import pickle
import zipfile
from pathlib import Path
from typing import Iterable, Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from .errors import CheckpointError
from .surgery.tied import find_tied_parameters

__all__ = ["read_state_dict", "load_state_dict_checked", "sha256_file", "StateDictMismatch"]

_WRAPPER_KEYS = ("state_dict", "model", "model_state_dict", "module", "state_dict_ema")


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(
            f"{path} is not a readable safetensors file; it is corrupt or truncated ({e}). "
            "Download it again or re-save it with safetensors.torch.save_file."
        ) from None


def _read_torch(path: Path) -> dict:
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" in str(e):
            raise CheckpointError(
                f"{path} holds Python objects besides tensors, which dpzoo does not unpickle "
                "(it could run arbitrary code). Save only the state dict: "
                "torch.save(model.state_dict(), path)."
            ) from None
        raise CheckpointError(f"{path} is corrupt or truncated: {e}") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError) as e:
        raise CheckpointError(
            f"{path} is corrupt or truncated ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else 'no detail'}). "
            "Download it again."
        ) from None
    return obj


def _unwrap(obj, path: Path) -> dict[str, torch.Tensor]:
    # Training checkpoints wrap the weights: {"state_dict": ...}, {"model": ...}, ...
    for _ in range(3):
        if isinstance(obj, Mapping) and not any(isinstance(v, torch.Tensor) for v in obj.values()):
            inner = next((obj[k] for k in _WRAPPER_KEYS if k in obj and isinstance(obj[k], Mapping)), None)
            if inner is None:
                break
            obj = inner
    if not isinstance(obj, Mapping) or not obj:
        raise CheckpointError(
            f"{path} holds no state dict (found {type(obj).__name__}); expected a mapping of tensor names to tensors."
        )
    sd = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    if not sd:
        raise CheckpointError(f"{path} holds no tensors (keys: {list(obj)[:8]}).")
    # DataParallel / DDP / torch.compile prefixes
    for prefix in ("module.", "_orig_mod."):
        if all(k.startswith(prefix) for k in sd):
            sd = {k[len(prefix) :]: v for k, v in sd.items()}
    return sd


def read_state_dict(path: str | os.PathLike, *, sha256: str | None = None) -> dict[str, torch.Tensor]:
    """Read a ``.safetensors`` or torch (``.pth``/``.pt``/``.bin``) checkpoint into a state dict.

    Wrappers such as ``{"state_dict": ...}`` and ``module.`` prefixes are removed. With
    ``sha256``, the file's digest is checked first.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"Checkpoint {path} does not exist.")
    if path.is_dir():
        raise CheckpointError(
            f"{path} is a directory; pass the checkpoint file inside it "
            "(or a Hugging Face model directory to a transformers zoo entry)."
        )
    if path.stat().st_size == 0:
        raise CheckpointError(f"{path} is empty (0 bytes): the download or save did not finish.")
    if sha256 is not None:
        got = sha256_file(path)
        if got != sha256.lower():
            raise CheckpointError(
                f"{path} has sha256 {got}, expected {sha256}: the file is "
                "corrupt, truncated or not the one the manifest describes."
            )
    with open(path, "rb") as f:
        head = f.read(8)
    is_safetensors = path.suffix == ".safetensors" or (
        len(head) == 8
        and int.from_bytes(head, "little") < 100_000_000
        and head[:2] != b"PK"
        and path.suffix not in (".pth", ".pt", ".bin", ".ckpt")
    )
    if is_safetensors:
        return _read_safetensors(path)
    return _unwrap(_read_torch(path), path)


class StateDictMismatch:
    """Missing, unexpected and mis-shaped keys between a state dict and a model."""

    def __init__(self, model: nn.Module, state_dict: Mapping[str, torch.Tensor]):
        expected = model.state_dict()
        self.missing = [k for k in expected if k not in state_dict]
        self.unexpected = [k for k in state_dict if k not in expected]
        self.mis_shaped = {
            k: (tuple(state_dict[k].shape), tuple(expected[k].shape))
            for k in expected
            if k in state_dict and state_dict[k].shape != expected[k].shape
        }

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.mis_shaped)

    def describe(self, limit: int = 12) -> str:
        def show(keys):
            keys = list(keys)
            more = f", ... ({len(keys) - limit} more)" if len(keys) > limit else ""
            return ", ".join(keys[:limit]) + more

        parts = []
        if self.missing:
            parts.append(f"missing from the checkpoint ({len(self.missing)}): {show(self.missing)}")
        if self.unexpected:
            parts.append(f"not in the model ({len(self.unexpected)}): {show(self.unexpected)}")
        if self.mis_shaped:
            parts.append(
                f"wrong shape ({len(self.mis_shaped)}): "
                + show(f"{k} {list(a)} in checkpoint vs {list(b)} in model" for k, (a, b) in self.mis_shaped.items())
            )
        return "; ".join(parts)


def load_state_dict_checked(
    model: nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    *,
    source: str = "checkpoint",
    allow_missing: Iterable[str] = (),
    ignore_unexpected: Iterable[str] = (),
    hint: str = "",
) -> StateDictMismatch:
    """Load strictly, or raise :class:`CheckpointError` naming every bad key.

    ``allow_missing`` / ``ignore_unexpected`` are fnmatch patterns of keys that may be
    missing (freshly initialised, e.g. a new classifier) or extra in the checkpoint.
    """
    allow_missing, ignore_unexpected = tuple(allow_missing), tuple(ignore_unexpected)
    sd = {k: v for k, v in state_dict.items() if not any(fnmatch.fnmatch(k, p) for p in ignore_unexpected)}
    # A tied tensor is often stored under one of its names only (safetensors' save_model,
    # HF checkpoints): fill the other names of its group from the stored one.
    for group in find_tied_parameters(model):
        present = [n for n in group.names if n in sd]
        for n in group.names:
            if present and n not in sd:
                sd[n] = sd[present[0]]
    mm = StateDictMismatch(model, sd)
    bad_missing = [k for k in mm.missing if not any(fnmatch.fnmatch(k, p) for p in allow_missing)]
    if bad_missing or mm.unexpected or mm.mis_shaped:
        shown = StateDictMismatch.__new__(StateDictMismatch)
        shown.missing, shown.unexpected, shown.mis_shaped = bad_missing, mm.unexpected, mm.mis_shaped
        raise CheckpointError(
            f"The {source} does not fit the model: {shown.describe()}." + (f" {hint}" if hint else "")
        )
    model.load_state_dict(sd, strict=False)
    return mm
