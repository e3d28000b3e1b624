"""``dpzoo.load`` and ``dpzoo.save``: build zoo entries, and write/read them exactly.

A saved model is a directory with ``model.safetensors`` (weights, shared tensors stored once),
``dpzoo_config.json`` (zoo name, overrides, patches, dtype and optional privacy metadata, also in
the safetensors header) and, for a transformers model, its ``config.json``. ``dpzoo.load(dir)`` rebuilds the architecture from the zoo and restores every
tensor bit for bit. Files get the permissions ``open`` would give (0666 less the umask).
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

import safetensors.torch
import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from ..errors import CheckpointError, OverrideError, SaveError
from ..integrations.opacus import unwrap_for_save
from ..integrations.peft_layers import is_peft_model
from ..integrations.peft_statements import refuse_save_of_stated_merges
from ..privacy.carried import attach_loaded_record, refuse_uncounted_spending, refuse_weights_of_unknown_origin
from ..privacy.engine import engine_of
from ..registry import LOAD_KEYWORDS, OVERRIDE_SYNONYMS, reject_unknown_overrides
from ..versions import __version__
from .checkpoint import give_default_permissions, load_state_dict_checked, state_dict_mismatch
from .privacy_card import CARD_NAME, render_card
from .privacy_record import (
    PRIVACY_FIELDS,
    check_privacy,
    privacy_from_header,
    privacy_to_json,
    refuse_file_beside_hf_record,
    spending_of,
)
from .saved_files import CONFIG_NAME, FORMAT_VERSION, HF_CONFIG_NAME, WEIGHTS_NAME, privacy_metadata, read_config
from .sharded_save import save_if_sharded

__all__ = ["load", "create_model", "save", "read_config", "privacy_metadata", "PRIVACY_FIELDS", "CONFIG_NAME"]
__all__ += ["WEIGHTS_NAME", "run_model_directory"]


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise OverrideError(
        f"Override value {value!r} ({type(value).__name__}) cannot be recorded for "
        "dpzoo.save; use numbers, strings, booleans, lists or dicts."
    )


def _refuse_dtype(overrides: dict) -> None:
    """``torch_dtype=`` / ``dtype=`` (transformers' habit) is not a model size: say what to do."""
    for key in ("torch_dtype", "dtype"):
        if key in overrides:
            raise OverrideError(
                f"dpzoo.load builds models in float32 and takes no {key}=; cast after loading "
                f"(model.to({overrides[key]!s})), or keep float32 weights and train under torch.autocast, "
                "which DP training prefers (the clipped sums stay in float32)."
            )


def load(
    name_or_dir: str | os.PathLike,
    *,
    pretrained: bool = False,
    pretrained_tag: str | None = None,
    weights: str | os.PathLike | None = None,
    **overrides,
) -> nn.Module:
    """Build a zoo model, or restore one saved with :func:`save`.

    Args:
        name_or_dir: a zoo name (``"resnet18-gn-bias"``, optionally ``".tag"`` for a pretrained
            tag, which may be a hub id: ``"bert-base.org/model-v1.5"``) or a directory written by :func:`save`.
        pretrained: load the entry's pretrained weights through timm's / transformers'
            own loading (needs their hub or cache), then patch them.
        pretrained_tag: the tag (timm) or hub id (transformers), instead of ``".tag"`` in the name.
        weights: a local checkpoint (timm ``.pth`` / ``.safetensors``, or a Hugging Face directory)
            loaded into the unpatched architecture before patching, so a pretrained BatchNorm model
            converts. One of the DP-ready model (a saved directory's ``model.safetensors``, or
            ``save_pretrained`` after patching) keeps its privacy record, composed when trained again.
        **overrides: sizes and patch options; ``dpzoo.model_card(name).overrides`` lists them.
            With a saved directory: overrides that keep every tensor's shape (dropout rates,
            pooling, ...) are applied, the others refused (:class:`OverrideError`).

    The returned model carries ``model.dpzoo_config`` (how to rebuild) and ``dpzoo_patch_report``.
    """
    # imported here: the zoo registers its entries on first lookup, not when this module loads
    from ..models import get_entry, split_name

    _refuse_dtype(overrides)
    name_or_dir = run_model_directory(name_or_dir)
    if _is_saved_directory(name_or_dir):
        if pretrained or pretrained_tag is not None or weights is not None:
            raise OverrideError(
                "dpzoo.load(dir) restores a saved model with its own weights; it takes no pretrained, "
                "pretrained_tag or weights. To start another model from them, load by name with "
                f"weights='{Path(name_or_dir) / WEIGHTS_NAME}'."
            )
        return _load_saved(Path(name_or_dir), overrides)
    name = str(name_or_dir)
    entry = get_entry(name)
    _, tag = split_name(name)
    if pretrained_tag is not None:
        if not isinstance(pretrained_tag, str) or not pretrained_tag:
            raise OverrideError(f"pretrained_tag must be a non-empty string, got {pretrained_tag!r}.")
        if tag is not None and tag != pretrained_tag:
            raise OverrideError(f"{name!r} names the tag {tag!r} but pretrained_tag={pretrained_tag!r}; give one.")
        tag = pretrained_tag
    if tag and not pretrained:
        raise OverrideError(f"{name!r} with tag {tag!r} loads pretrained weights; pass pretrained=True (or no tag).")
    params = inspect.signature(entry.builder).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):  # a user's builder with fixed keywords
        reject_unknown_overrides(entry.name, overrides, [n for n in params if n not in LOAD_KEYWORDS])
    if weights is not None:
        if not entry.accepts_weights:
            raise OverrideError(f"{entry.name}'s builder does not take weights=PATH.")
        if not Path(weights).exists():
            raise CheckpointError(f"weights={str(weights)!r} does not exist.")
    recorded = _jsonable(overrides)
    kwargs = dict(overrides)
    if pretrained:
        kwargs.update(pretrained=True, pretrained_tag=tag)
    if weights is not None:
        kwargs["weights"] = weights
    model = entry.builder(**kwargs)
    spent = _privacy_of_weights(Path(weights)) if weights is not None else None
    if spent:  # a DP-trained checkpoint keeps its spending, so training it again composes it
        attach_loaded_record(model, spent)
    model.dpzoo_config = {
        "model_name": entry.name,
        "overrides": recorded,
        "pretrained": bool(pretrained),
        "pretrained_tag": tag,
        "weights": str(weights) if weights is not None else None,
    }
    return model


def _privacy_of_weights(path: Path) -> dict[str, Any] | None:
    """The privacy record of a ``weights=`` checkpoint :func:`save` wrote: its directory's config, else
    the safetensors header (a file copied alone), else None; refused beside an HF config's record."""
    refuse_file_beside_hf_record(path)
    directory = path if path.is_dir() else path.parent
    if (directory / CONFIG_NAME).is_file() and (path.is_dir() or path.name == WEIGHTS_NAME):
        return read_config(directory).get("privacy")
    file = path / WEIGHTS_NAME if path.is_dir() else path
    if file.suffix != ".safetensors" or not file.is_file():
        return None
    try:
        with safe_open(str(file), "pt") as f:
            header = f.metadata()
    except (SafetensorError, OSError, ValueError):
        return None  # the architecture's own loading reports a broken file
    return privacy_from_header(header, f"weights={str(path)!r}")


def run_model_directory(name_or_dir):
    """The model of a ``dpzoo train --out`` directory (its ``model/``), else ``name_or_dir``."""
    path = Path(name_or_dir)
    if not path.is_dir() or (path / CONFIG_NAME).is_file():
        return name_or_dir
    if (path / "model" / CONFIG_NAME).is_file():
        return path / "model"
    if (path / "checkpoint.pt").is_file() or (path / "metrics.csv").is_file():
        raise CheckpointError(
            f"{path} is a dpzoo train run with no saved model yet (the run did not finish): finish it with "
            f"`dpzoo train --resume {path}`; the model is saved to {path / 'model'} at the end."
        )
    return name_or_dir


def _is_saved_directory(name_or_dir: str | os.PathLike) -> bool:
    """A path (a directory written by save) rather than a zoo name, whose tag may be a hub id with "/"."""
    from ..models import is_model

    text, path = str(name_or_dir), Path(name_or_dir)
    if isinstance(name_or_dir, os.PathLike) or (path / CONFIG_NAME).is_file():
        return True
    return not is_model(text) and (path.is_dir() or os.sep in text or "/" in text)


create_model = load  # timm's name for the same call


def _model_dtype(model: nn.Module) -> str | None:
    dtypes = {p.dtype for p in model.parameters() if p.dtype.is_floating_point}
    return str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else None


def save(
    model: nn.Module,
    directory: str | os.PathLike,
    *,
    privacy: Mapping[str, Any] | None = None,
    overwrite: bool = True,
    datasets: Sequence[str] | None = None,
) -> Path:
    """Write ``model`` to ``directory`` (safetensors + JSON), atomically (through a temporary directory).

    ``privacy``: optional DP metadata (epsilon, delta, accountant, steps, sample_rate and
    optionally noise_multiplier, max_grad_norm, privacy_unit); it goes into the JSON and
    into the safetensors header. A model trained by dpzoo's engine fills it in itself; one Opacus
    wrapped is unwrapped and needs ``privacy=dpzoo.integrations.opacus.privacy_metadata(engine, delta, data_loader=loader)``.
    ``datasets``: names of the (public, named) datasets it was trained on, for its card's front matter
    (``README.md``, :mod:`dpzoo.hub.privacy_card`; never a private file's path).
    """
    if (sharded := save_if_sharded(model, directory, save, privacy, overwrite)) is not None:
        return sharded  # FSDP2: every rank gathers, rank 0 writes (dpzoo.hub.sharded_save)
    _refuse_peft_save(model)
    model = unwrap_for_save(model, privacy)  # Opacus' GradSampleModule -> the zoo model
    config = getattr(model, "dpzoo_config", None)
    if not isinstance(config, dict) or "model_name" not in config:
        raise SaveError(
            "dpzoo.save needs a model built by dpzoo.load (it records how to rebuild "
            "the architecture). For any other module use safetensors.torch.save_model, "
            "or register a builder with @dpzoo.register_model."
        )
    if privacy is None:  # a model trained by dpzoo's engine carries its privacy spend ({}: stated disjoint)
        engine = engine_of(model)
        live = engine is not None and engine.steps > 0
        privacy = engine.privacy_metadata() if live else getattr(model, "dpzoo_privacy", None) or None
    privacy = check_privacy(privacy)
    refuse_uncounted_spending(model, privacy)  # a record that leaves out what the model carries undercounts
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise SaveError(f"{directory} exists and is not a directory.")
    if directory.is_dir() and any(directory.iterdir()):
        if not (directory / CONFIG_NAME).exists():
            raise SaveError(
                f"{directory} is not empty and holds no dpzoo model; refusing to write "
                "into it. Choose an empty or new directory."
            )
        if not overwrite:
            raise SaveError(f"{directory} already holds a dpzoo model; pass overwrite=True to replace it.")
    report = getattr(model, "dpzoo_patch_report", None)
    meta = {
        "format_version": FORMAT_VERSION,
        "dpzoo_version": __version__,
        "torch_version": torch.__version__,
        **config,
        "dtype": _model_dtype(model),
        "patches": report.to_dict() if report is not None else None,
        "privacy": privacy_to_json(privacy),
    }
    st_meta = {"format": "pt", "dpzoo.model_name": config["model_name"]}
    if privacy:
        st_meta.update({f"dpzoo.privacy.{k}": str(v) for k, v in privacy.items()})
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        safetensors.torch.save_model(model, str(tmp / WEIGHTS_NAME), metadata=st_meta)
        (tmp / CONFIG_NAME).write_text(json.dumps(meta, indent=2, sort_keys=True, allow_nan=False) + "\n")
        base = config.get("pretrained_tag") if config.get("pretrained") else None
        card = render_card(config["model_name"], privacy, base_model=base, datasets=datasets)
        (tmp / CARD_NAME).write_text(card, encoding="utf-8")
        _write_library_config(model, tmp, privacy)
        give_default_permissions(tmp)  # mkdtemp made it 0700: as mkdir/open would, under the umask
        if directory.exists():
            old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
            os.replace(directory, old)
            os.replace(tmp, directory)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def _write_library_config(model: nn.Module, directory: Path, privacy: Mapping[str, Any] | None) -> None:
    """A transformers model's own ``config.json`` (its sizes came from its checkpoint; :func:`load`
    rebuilds it from it), with the spending ``from_pretrained`` of any copy composes (``dpzoo_privacy``)."""
    config = getattr(model, "config", None)
    if callable(getattr(config, "to_json_string", None)) and callable(getattr(model, "save_pretrained", None)):
        data = json.loads(config.to_json_string())
        data.update({"dpzoo_privacy": spending_of(privacy)} if privacy else {})
        (directory / HF_CONFIG_NAME).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _merge_overrides(saved: dict[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """The saved overrides updated with ``given``; a given synonym (num_labels) replaces the saved name."""
    merged = dict(saved)
    for key in given:
        for synonym, canonical in OVERRIDE_SYNONYMS.items():
            if key in (synonym, canonical):
                merged.pop(synonym, None)
                merged.pop(canonical, None)
    return {**merged, **given}


def _shape_change(directory: Path, name: str, given: Mapping[str, Any], merged: dict, why: str) -> OverrideError:
    """The error for overrides of ``dpzoo.load(dir)`` that do not keep the saved tensors' shapes."""
    source = directory if (directory / HF_CONFIG_NAME).is_file() else directory / WEIGHTS_NAME
    call = ", ".join([repr(name), f"weights='{source}'"] + [f"{k}={v!r}" for k, v in merged.items()])
    return OverrideError(
        "dpzoo.load(dir) applies only overrides that keep every saved tensor's shape (dropout rates, pooling, "
        f"...); {', '.join(f'{k}={v!r}' for k, v in given.items())} would change the weights saved in {directory} "
        f"({why}). To start from them with a new head or other sizes, load by name: dpzoo.load({call}) (a "
        "classifier of another size is initialised anew); or load the directory as it is and replace the head."
    )


def _rebuild(directory: Path, name: str, merged: dict[str, Any], given: Mapping[str, Any]) -> nn.Module:
    """The saved model's architecture, built by the zoo: a transformers model from its saved config and
    weights (the directory is a Hugging Face one too), any other from the recorded overrides."""
    from ..models import get_entry

    if not (directory / HF_CONFIG_NAME).is_file() or not get_entry(name).accepts_weights:
        return load(name, **merged)
    try:
        return load(name, weights=directory, **merged)
    except CheckpointError as e:
        if not given:
            raise
        raise _shape_change(directory, name, given, merged, str(e)) from None


def _load_saved(directory: Path, given: Mapping[str, Any] | None = None) -> nn.Module:
    cfg = read_config(directory)
    weights_path = directory / WEIGHTS_NAME
    if not weights_path.exists():
        raise SaveError(f"{directory} has no {WEIGHTS_NAME}.")
    patches = cfg.get("patches") or {}
    given = dict(given or {})
    overrides = _merge_overrides(dict(cfg.get("overrides") or {}), given)
    model = _rebuild(directory, cfg["model_name"], overrides, given)
    if cfg.get("dtype"):
        model = model.to(getattr(torch, cfg["dtype"]))
    try:
        with safe_open(str(weights_path), "pt") as f:
            state = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{weights_path} is corrupt or truncated ({e}).") from None
    mismatch = state_dict_mismatch(model, state) if given else None
    if mismatch:  # built from the overrides, but the saved tensors do not fit it
        raise _shape_change(directory, cfg["model_name"], given, overrides, mismatch.describe(limit=4))
    # save_model stores a tied tensor once; load_state_dict_checked fills its other names.
    load_state_dict_checked(model, state, source=f"saved model {directory}")
    if patches and model.dpzoo_patch_report.to_dict().get("biases_added") != patches.get("biases_added"):
        raise SaveError(
            f"{directory}: rebuilding {cfg['model_name']} patched different layers than the "
            "saved model had (different dpzoo version?)."
        )
    config = {k: cfg.get(k) for k in ("model_name", "overrides", "pretrained", "pretrained_tag", "weights")}
    model.dpzoo_config = {**config, "overrides": _jsonable(overrides)} if given else config  # what a re-save records
    if cfg.get("privacy"):
        attach_loaded_record(model, cfg["privacy"])
    return model


def _refuse_peft_save(model: nn.Module) -> None:
    """Refuse to save a PEFT model (its state dict is the wrapper's, which :func:`load` cannot
    rebuild), saying what to save instead; and merged weights whose origin is unknown or stated."""
    refuse_weights_of_unknown_origin(model, stated_disjoint=False)  # merged ones of unknown origin: saved, lost
    refuse_save_of_stated_merges(model)
    if is_peft_model(model):
        raise SaveError(
            f"{type(model).__name__} is a PEFT model, and dpzoo.save writes whole zoo models: save "
            "model.merge_and_unload() (the zoo model with the adapters merged in; it keeps the privacy record of "
            "the engine that trained it), or the adapters alone with model.save_pretrained(dir)."
        )
