"""Read checkpoints safely and load them with errors that name every bad tensor (also: the file
permissions a written checkpoint gets)."""

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

from ..errors import CheckpointError
from ..surgery.tied import find_tied_parameters

__all__ = [
    "read_state_dict",
    "load_state_dict_checked",
    "sha256_file",
    "StateDictMismatch",
    "state_dict_mismatch",
    "split_dp_ready_state_dict",
    "load_added_biases",
    "lacks_bias",
    "give_default_permissions",
]

_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_RUNNING_STATS = ("running_mean", "running_var", "num_batches_tracked")

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


def _fill_tied(model: nn.Module, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # A tied tensor is often stored under one of its names only (safetensors' save_model,
    # HF checkpoints): fill the other names of its group from the stored one.
    for group in find_tied_parameters(model):
        present = [n for n in group.names if n in sd]
        for n in group.names:
            if present and n not in sd:
                sd[n] = sd[present[0]]
    return sd


def state_dict_mismatch(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> StateDictMismatch:
    """The missing, unexpected and mis-shaped keys of ``state_dict`` for ``model``, a tied tensor
    stored under one of its names counting for all of them (as :func:`load_state_dict_checked` loads)."""
    return StateDictMismatch(model, _fill_tied(model, dict(state_dict)))


def lacks_bias(module: nn.Module) -> bool:
    """A layer with a weight and no bias: one BiTFiT-Add gives a bias (not e.g. an ``nn.Identity``)."""
    return isinstance(getattr(module, "weight", None), torch.Tensor) and getattr(module, "bias", None) is None


def split_dp_ready_state_dict(
    model: nn.Module, state_dict: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[str]]:
    """Prepare a checkpoint written from a DP-ready model (``dpzoo.save``, or ``save_pretrained``
    after dpzoo's surgery) for loading into ``model``, the architecture before the surgery.

    Returns (the tensors ``model`` takes; the biases BiTFiT-Add adds, keyed ``<module>.bias`` for a
    module of ``model`` that has no bias, to load after patching with :func:`load_added_biases`;
    fnmatch patterns of BatchNorm running statistics the checkpoint lacks, which may be missing
    because BatchNorm → GroupNorm drops them). A checkpoint of the unpatched architecture comes back
    unchanged with nothing added.
    """
    modules = dict(model.named_modules())
    expected = model.state_dict()
    base: dict[str, torch.Tensor] = {}
    added: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        owner, _, leaf = key.rpartition(".")
        if leaf == "bias" and key not in expected and owner in modules and lacks_bias(modules[owner]):
            added[key] = value
        else:
            base[key] = value
    allow_missing = [
        f"{name}.{stat}"
        for name, m in modules.items()
        if isinstance(m, _BATCHNORMS) and name and f"{name}.running_mean" not in state_dict
        for stat in _RUNNING_STATS
    ]
    return base, added, allow_missing


def load_added_biases(model: nn.Module, biases: Mapping[str, torch.Tensor], *, source: str, prefix: str = "") -> None:
    """Copy the biases :func:`split_dp_ready_state_dict` set aside into the patched ``model``
    (a key not found as is is tried under ``prefix.``); raise :class:`CheckpointError` naming every
    bias the patched model does not have or has with another shape."""
    params = dict(model.named_parameters(remove_duplicate=False))
    bad, pairs = [], []
    for key, value in biases.items():
        name = key if key in params or not prefix else f"{prefix}.{key}"
        p = params.get(name)
        if p is None or p.shape != value.shape:
            got = "not in the patched model" if p is None else f"{list(value.shape)} vs {list(p.shape)}"
            bad.append(f"{key} ({got})")
        else:
            pairs.append((p, value))
    if bad:
        raise CheckpointError(
            f"The {source} has biases the DP-ready model cannot take: {', '.join(bad[:12])}"
            + (f", ... ({len(bad) - 12} more)" if len(bad) > 12 else "")
            + ". Was it saved from a model patched with other options (bias_exempt, add_bias)?"
        )
    with torch.no_grad():
        for p, value in pairs:
            p.copy_(value.to(dtype=p.dtype, device=p.device))


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
    sd = _fill_tied(model, sd)
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


def _umask() -> int:
    """The process's umask, read without changing it where Linux reports it (/proc/self/status)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore at once
    os.umask(mask)
    return mask


def give_default_permissions(directory: str | os.PathLike) -> None:
    """``directory`` 0777 and the files in it 0666, less the umask: what ``mkdir`` and ``open`` give
    (tempfile makes its directories 0700, and the saved model is meant to be shared like any file)."""
    mask = _umask()
    for f in Path(directory).iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~mask)
    os.chmod(directory, 0o777 & ~mask)
