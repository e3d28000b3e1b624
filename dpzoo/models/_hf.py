"""Builders for zoo entries backed by Hugging Face transformers models."""

from __future__ import annotations

import contextlib
import fnmatch
import json
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import try_to_load_from_cache
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers.utils import logging as hf_logging

from ..errors import CheckpointError, OverrideError
from ..hub.checkpoint import (
    lacks_bias,
    load_added_biases,
    load_state_dict_checked,
    read_state_dict,
    split_dp_ready_state_dict,
)
from ..nn.hf_position_ids import with_per_sample_position_ids
from ..surgery import make_dp_ready
from ._common import reject_unknown, split_patch_options
from .hub_reach import offline_unless_reachable


@contextlib.contextmanager
def _quiet_transformers():
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _config_kwargs(entry: str, config_cls, aliases: dict[str, str], arch_over: dict[str, Any]) -> dict:
    defaults = config_cls()
    # the aliases, their targets (num_labels is a property of the config, not a stored field) and
    # every stored config field
    accepted = set(aliases) | set(aliases.values()) | {k for k in vars(defaults) if not k.startswith("_")}
    reject_unknown(entry, arch_over, accepted)
    out: dict[str, Any] = {}
    given: dict[str, str] = {}  # config field -> the override that set it
    for key, value in arch_over.items():
        target = aliases.get(key, key)
        if target == "num_labels":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise OverrideError(f"{key} must be an integer >= 1, got {value!r}")
        if target in out and out[target] != value:  # e.g. num_classes=3 and num_labels=5
            raise OverrideError(
                f"{entry}: {given[target]}={out[target]!r} and {key}={value!r} both set the config's "
                f"{target} to different values; pass only one of them."
            )
        out[target], given[target] = value, key
    return out


def _checkpoint_files(source: str) -> list[Path]:
    """The weight files of a Hugging Face directory, or of a hub id already in the local cache."""
    path = Path(source)
    if path.is_dir():
        return sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
    for index, single in (
        ("model.safetensors.index.json", "model.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin"),
    ):
        found = try_to_load_from_cache(source, index)
        if isinstance(found, str):
            shards = sorted(set(json.loads(Path(found).read_text())["weight_map"].values()))
            files = [try_to_load_from_cache(source, shard) for shard in shards]
            return [Path(f) for f in files if isinstance(f, str)]
        found = try_to_load_from_cache(source, single)
        if isinstance(found, str):
            return [Path(found)]
    return []


def _read_tensors(source: str, keys: list[str]) -> dict[str, torch.Tensor]:
    """The tensors named ``keys`` from the checkpoint files of ``source``."""
    wanted, out = set(keys), {}
    for f in _checkpoint_files(source):
        if f.suffix == ".safetensors":
            with safe_open(str(f), "pt") as h:
                out.update({k: h.get_tensor(k) for k in h.keys() if k in wanted})
        else:
            out.update({k: v for k, v in read_state_dict(f).items() if k in wanted})
    return out


def _added_bias_keys(model: nn.Module, keys: list[str]) -> list[str]:
    """Checkpoint keys ``<module>.bias`` for a module of the unpatched ``model`` without a bias: a
    checkpoint saved after dpzoo's surgery (``save_pretrained`` of a zoo model) carries them."""
    modules = dict(model.named_modules())
    prefix = getattr(model, "base_model_prefix", "")
    found = []
    for key in keys:
        owner, _, leaf = key.rpartition(".")
        module = modules.get(owner, modules.get(f"{prefix}.{owner}"))
        if leaf == "bias" and module is not None and lacks_bias(module):
            found.append(key)
    return found


def _drop_new_head(model: nn.Module, sd: dict, head_keys: tuple[str, ...]) -> dict:
    """``sd`` without the head tensors whose shape differs from ``model``'s (another num_labels)."""
    expected = model.state_dict()
    return {
        k: v
        for k, v in sd.items()
        if not (any(fnmatch.fnmatch(k, p) for p in head_keys) and k in expected and expected[k].shape != v.shape)
    }


def _check_hf_dir(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise CheckpointError(
            f"{path} has no config.json, so it is not a Hugging Face model "
            "directory. Pass the directory `save_pretrained` wrote, or a single "
            "weights file (.safetensors / .bin)."
        )
    try:
        json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path / 'config.json'} is not valid JSON ({e}).") from None
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise CheckpointError(f"{path} has no weights (model.safetensors or pytorch_model.bin).")
    for f in files:  # surface corruption as a clear error before transformers sees it
        if f.suffix == ".safetensors":
            try:
                with safe_open(str(f), "pt") as h:
                    for k in h.keys():
                        h.get_slice(k)
            except (SafetensorError, OSError, ValueError) as e:
                raise CheckpointError(f"{f} is corrupt or truncated ({e}).") from None
        else:
            read_state_dict(f)


def build_hf(
    entry: str,
    model_cls,
    config_cls,
    *,
    pretrained: bool,
    pretrained_tag: str | None,
    weights,
    overrides: dict[str, Any],
    aliases: dict[str, str],
    base_config: dict[str, Any],
    head_keys: tuple[str, ...] = (),
    ignorable_unexpected: tuple[str, ...] = (),
    bias_exempt: tuple[str, ...] = (),
    hub_id: str | None = None,
    per_sample_positions: bool = False,
) -> nn.Module:
    """Build ``model_cls``, load weights (hub, HF directory or weights file), then patch it.

    ``head_keys``: patterns of checkpoint keys that may be missing (a new task head).
    ``ignorable_unexpected``: checkpoint keys a task model does not use (pre-training heads).
    """
    arch_over, patch_kw = split_patch_options(overrides)
    patch_kw.setdefault("bias_exempt", bias_exempt)
    cfg_kwargs = _config_kwargs(entry, config_cls, aliases, arch_over)
    if pretrained and weights is not None:
        raise OverrideError("Pass either pretrained=True or weights=PATH, not both.")
    source = None
    added: dict[str, torch.Tensor] = {}
    if pretrained:
        source = pretrained_tag or hub_id
        if source is None:
            raise CheckpointError(f"{entry} has no pretrained weights; pass weights=PATH.")
    elif weights is not None and Path(weights).is_dir():
        source = Path(weights)
        _check_hf_dir(source)
    if source is not None:
        model, added = _from_pretrained(
            entry, model_cls, source, pretrained, cfg_kwargs, head_keys, ignorable_unexpected
        )
    else:
        model = model_cls(config_cls(**{**base_config, **cfg_kwargs}))
        if weights is not None:
            added = _load_weights_file(model, weights, "num_labels" in cfg_kwargs, head_keys, ignorable_unexpected)
    model.eval()  # like from_pretrained; call .train() before training
    model = make_dp_ready(model, **patch_kw)
    if added:
        load_added_biases(
            model, added, source=f"checkpoint {source or weights}", prefix=getattr(model, "base_model_prefix", "")
        )
    if per_sample_positions:
        with_per_sample_position_ids(model)
        model.dpzoo_patch_report.position_ids_per_sample = True
    return model


def _from_pretrained(entry, model_cls, source, pretrained, cfg_kwargs, head_keys, ignorable_unexpected):
    """(model, biases dpzoo added that the checkpoint holds) from a hub id or a Hugging Face
    directory; every key that does not fit is refused by name."""
    with _quiet_transformers(), offline_unless_reachable() if pretrained else contextlib.nullcontext():
        try:
            # mismatches come back in `info` and are reported below, by name
            model, info = model_cls.from_pretrained(
                str(source), output_loading_info=True, ignore_mismatched_sizes=True, **cfg_kwargs
            )
        except (OSError, EnvironmentError) as e:
            raise CheckpointError(
                f"transformers could not load {source!s} ({str(e).splitlines()[0]}). Offline? "
                "Download the model where the hub is reachable and pass weights=DIR."
            ) from None
        except (ValueError, RuntimeError, TypeError) as e:
            raise CheckpointError(f"{source!s} does not fit {entry}: {e}") from None
    bad_missing = sorted(k for k in info["missing_keys"] if not any(fnmatch.fnmatch(k, p) for p in head_keys))
    unexpected = sorted(
        k for k in info["unexpected_keys"] if not any(fnmatch.fnmatch(k, p) for p in ignorable_unexpected)
    )
    # a checkpoint saved after dpzoo's surgery: its config does not know the added biases, so
    # transformers built the model without them; they are loaded once the model is patched
    added = _read_tensors(str(source), _added_bias_keys(model, unexpected))
    unexpected = [k for k in unexpected if k not in added]
    mismatched = sorted(k[0] if isinstance(k, tuple) else str(k) for k in info["mismatched_keys"])
    if "num_labels" in cfg_kwargs:  # a new head for another number of classes is expected
        mismatched = [k for k in mismatched if not any(fnmatch.fnmatch(k, p) for p in head_keys)]
    if bad_missing or unexpected or mismatched:
        parts = []
        if bad_missing:
            parts.append(f"missing from the checkpoint ({len(bad_missing)}): {', '.join(bad_missing[:12])}")
        if unexpected:
            parts.append(
                f"not in the model ({len(unexpected)}): {', '.join(unexpected[:12])}"
                + (" ..." if len(unexpected) > 12 else "")
            )
        if mismatched:
            parts.append(f"wrong shape: {', '.join(mismatched[:12])}")
        raise CheckpointError(
            f"The checkpoint {source!s} does not fit {entry}: {'; '.join(parts)}. "
            "Size overrides must match the checkpoint's config."
        )
    return model, added


def _load_weights_file(model, weights, new_head: bool, head_keys, ignorable_unexpected) -> dict[str, torch.Tensor]:
    """Load a weights file into the freshly built ``model``; returns the biases dpzoo added that
    the file holds (loaded once the model is patched)."""
    sd = read_state_dict(weights)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    if new_head:  # a new head for another number of classes is expected
        sd = _drop_new_head(model, sd, head_keys)
    sd, added, allow_bn = split_dp_ready_state_dict(model, sd)
    load_state_dict_checked(
        model,
        sd,
        source=f"checkpoint {weights}",
        allow_missing=head_keys + tuple(allow_bn),
        ignore_unexpected=ignorable_unexpected,
        hint="Size overrides must match the checkpoint's.",
    )
    return added
