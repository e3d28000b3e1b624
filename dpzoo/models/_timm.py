"""Builders for zoo entries backed by timm models, and the override kinds their tables use."""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import sys
from typing import Any, Callable, Iterable, Mapping

import timm
import torch
from torch import nn

from ..errors import CheckpointError, OverrideError
from ..hub.checkpoint import load_added_biases, load_state_dict_checked, read_state_dict, split_dp_ready_state_dict
from ..registry import ModelCard, register_model
from ..surgery import make_dp_ready
from ._common import Override, OverrideTable, library_kwargs, resolve_synonyms, split_patch_options
from .hub_reach import offline_unless_reachable

log = logging.getLogger("dpzoo")

# timm's feature-extraction keywords: the model they build wraps the classifier network.
FEATURE_KWARGS = ("features_only", "out_indices")


@contextlib.contextmanager
def timm_rejections(arch: str, kwargs: Mapping[str, Any]):
    """What timm raises while building ``arch`` from ``kwargs``, as an :class:`OverrideError`."""
    try:
        yield
    except TypeError as e:  # an argument the timm architecture does not take
        raise OverrideError(f"timm's {arch.split('.')[0]} rejected the overrides {dict(kwargs)}: {e}") from None
    except (AssertionError, ValueError) as e:  # inconsistent sizes (e.g. img_size % patch_size)
        raise OverrideError(f"timm's {arch.split('.')[0]} cannot be built with {dict(kwargs)}: {e}") from None


def _create(arch: str, pretrained: bool, **kwargs) -> nn.Module:
    with timm_rejections(arch, kwargs):
        return timm.create_model(arch, pretrained=pretrained, **kwargs)


def load_local_checkpoint(
    model: nn.Module,
    path,
    *,
    num_classes_overridden: bool,
    entry: str,
    convert_state_dict: Callable[[dict], dict] | None = None,
    ignore_unexpected: Iterable[str] = (),
) -> dict[str, torch.Tensor]:
    """Load a local checkpoint file into a timm ``model`` (before dpzoo's surgery): the entry's own
    key mapping, then timm's ``checkpoint_filter_fn``, then a strict load (a new head may be missing
    when ``num_classes_overridden``; ``ignore_unexpected``: fnmatch patterns of keys to skip).

    A checkpoint of the DP-ready model (``dpzoo.save``'s ``model.safetensors``) loads too: its added
    biases are returned, to load with :func:`dpzoo.hub.checkpoint.load_added_biases` after patching, and
    the BatchNorm running statistics GroupNorm dropped may be missing. Returns {} otherwise.
    """
    sd = dict(path) if isinstance(path, Mapping) else read_state_dict(path)  # a file, or a state dict in memory
    if convert_state_dict is not None:  # the entry's own key mapping (e.g. another library's names)
        sd = convert_state_dict(sd)
    ignore_unexpected = tuple(ignore_unexpected)
    sd = {k: v for k, v in sd.items() if not any(fnmatch.fnmatch(k, p) for p in ignore_unexpected)}
    sd, added, allow_missing = split_dp_ready_state_dict(model, sd)
    module = sys.modules.get(type(model).__module__)
    filter_fn: Callable | None = getattr(module, "checkpoint_filter_fn", None)
    if filter_fn is not None:  # timm's own conversions (e.g. ViT position-embedding resampling)
        try:
            sd = filter_fn(sd, model)
        except Exception as e:
            raise CheckpointError(f"{path}: timm could not adapt this checkpoint to {entry} ({e}).") from None
    classifier = (getattr(model, "pretrained_cfg", None) or {}).get("classifier")
    if classifier and num_classes_overridden:
        # timm's convention: asking for another num_classes re-initialises the head.
        expected = model.state_dict()
        head_keys = [k for k in sd if k.startswith(classifier + ".")]
        if any(k not in expected or sd[k].shape != expected[k].shape for k in head_keys):  # 0: no classifier
            log.info("%s: classifier %s re-initialised for the new num_classes", entry, classifier)
            sd = {k: v for k, v in sd.items() if k not in head_keys}
            allow_missing.append(classifier + ".*")
    load_state_dict_checked(
        model,
        sd,
        source=f"checkpoint {path}",
        allow_missing=allow_missing,
        hint=f"Is it a checkpoint of timm's {type(model).__name__} with the same "
        f"sizes? Pass the matching overrides (dpzoo.model_card({entry!r})).",
    )
    return added


def load_into_feature_extractor(
    model: nn.Module,
    arch: str,
    kwargs: dict[str, Any],
    path,
    *,
    entry: str,
    convert_state_dict: Callable[[dict], dict] | None = None,
) -> dict[str, torch.Tensor]:
    """Load a classifier checkpoint into ``model``, timm's ``features_only`` wrapper of ``arch``
    (before dpzoo's surgery), as timm does for pretrained weights: into the whole network first
    (built without a classifier), then the layers the feature extractor keeps. Returns the added
    biases of a DP-ready checkpoint that belong to those layers (see :func:`load_local_checkpoint`)."""
    full = _create(arch, False, **{k: v for k, v in kwargs.items() if k not in FEATURE_KWARGS}, num_classes=0)
    classifier = (getattr(full, "pretrained_cfg", None) or {}).get("classifier")
    skip = [f"{classifier}.*"] if isinstance(classifier, str) else []
    added = load_local_checkpoint(
        full,
        path,
        num_classes_overridden=False,
        entry=entry,
        convert_state_dict=convert_state_dict,
        ignore_unexpected=skip,
    )
    full_sd, keys = full.state_dict(), list(model.state_dict())
    # timm's FeatureListNet keeps the network's names; FeatureGetterNet (ViT) nests it as `model.`
    prefix = next((p for p in ("", "model.") if all(k.startswith(p) and k[len(p) :] in full_sd for k in keys)), None)
    if prefix is None:
        raise OverrideError(f"{entry}: weights=PATH cannot be mapped onto timm's feature extractor of {arch}.")
    model.load_state_dict({k: full_sd[k[len(prefix) :]] for k in keys}, strict=True)
    modules = dict(model.named_modules())
    return {prefix + k: v for k, v in added.items() if prefix + k.rpartition(".")[0] in modules}


def build_timm(
    entry: str,
    arch: str,
    *,
    pretrained: bool,
    pretrained_tag: str | None,
    weights,
    overrides: dict[str, Any],
    overrides_table: OverrideTable,
    base_kwargs: dict[str, Any] | None = None,
    patch_defaults: dict[str, Any] | None = None,
    convert_state_dict: Callable[[dict], dict] | None = None,
    tag_sources: Mapping[str, str] | None = None,
    create: Callable[..., nn.Module] | None = None,
) -> nn.Module:
    """Build timm's ``arch``, load weights, then apply dpzoo's patches.

    ``overrides_table`` declares each user-facing override (its card text and its timm kwargs).
    ``convert_state_dict`` maps a ``weights=PATH`` state dict to timm's keys; it runs right
    after the file is read, before timm's own ``checkpoint_filter_fn``. ``tag_sources``: pretrained
    tags whose weights are another timm architecture's with the same tensors (``"gn_a1h_in1k":
    "resnet50_gn.a1h_in1k"``, GroupNorm-trained), loaded as a local checkpoint would be. ``create``:
    how the randomly initialised network is built (``create(arch, **kwargs)``; default
    ``timm.create_model``), for architectures whose sizes timm keeps in a configuration object.
    """
    build = create or (lambda name, **kw: _create(name, False, **kw))
    arch_over, patch_kw = split_patch_options(overrides, patch_defaults)
    arch_over = resolve_synonyms(entry, arch_over, overrides_table)
    kwargs = {**(base_kwargs or {}), **library_kwargs(entry, overrides_table, arch_over)}
    features = bool(kwargs.pop("features_only", False))
    if "out_indices" in kwargs and not features:
        raise OverrideError(f"{entry}: out_indices selects the feature maps of features_only=True; pass both.")
    if features:
        if "num_classes" in arch_over:
            raise OverrideError(
                f"{entry}: features_only=True removes the classifier, so num_classes has no effect; drop one of them."
            )
        kwargs["features_only"] = True
    if pretrained and weights is not None:
        raise OverrideError("Pass either pretrained=True or weights=PATH, not both.")
    added: dict[str, torch.Tensor] = {}
    source = (tag_sources or {}).get(pretrained_tag or "")
    if pretrained and source is not None:  # weights of another timm architecture with the same tensors
        model = build(arch, **kwargs)
        added = load_local_checkpoint(
            model, timm_pretrained(source, kwargs).state_dict(), num_classes_overridden=True, entry=entry
        )
    elif pretrained:
        model = timm_pretrained(f"{arch}.{pretrained_tag}" if pretrained_tag else arch, kwargs)
    else:
        model = build(arch, **kwargs)
        if weights is not None and features:
            added = load_into_feature_extractor(
                model, arch, kwargs, weights, entry=entry, convert_state_dict=convert_state_dict
            )
        elif weights is not None:
            added = load_local_checkpoint(
                model,
                weights,
                num_classes_overridden="num_classes" in arch_over,
                entry=entry,
                convert_state_dict=convert_state_dict,
            )
    model = make_dp_ready(model, **patch_kw)
    if weights is not None and added:  # biases of a checkpoint saved from the DP-ready model
        load_added_biases(model, added, source=f"checkpoint {weights}")
    return model


def timm_pretrained(name: str, kwargs: dict[str, Any]) -> nn.Module:
    """timm's ``name`` with its pretrained weights (from the hub, or timm's cache when offline)."""
    try:
        with offline_unless_reachable():
            return _create(name, True, **kwargs)
    except (OverrideError, CheckpointError):
        raise
    except Exception as e:  # hub unreachable, unknown tag, ...
        raise CheckpointError(
            f"timm could not fetch pretrained weights for {name!r} ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}). Offline? Download the checkpoint "
            f"where the hub is reachable and pass weights=PATH."
        ) from None


def register_timm_entry(
    card: ModelCard,
    arch: str,
    *,
    default_tag: str | None,
    overrides_table: OverrideTable,
    convert_state_dict: Callable[[dict], dict] | None = None,
    tag_sources: Mapping[str, str] | None = None,
    create: Callable[..., nn.Module] | None = None,
) -> Callable[..., nn.Module]:
    """Register the zoo entry ``card.name``: timm's ``arch`` built by :func:`build_timm` with the
    entry's override table (the one build path of every timm entry). Returns the builder."""

    def build(pretrained: bool = False, pretrained_tag: str | None = None, weights=None, **overrides) -> nn.Module:
        return build_timm(
            card.name,
            arch,
            pretrained=pretrained,
            pretrained_tag=pretrained_tag or default_tag,
            weights=weights,
            overrides=overrides,
            overrides_table=overrides_table,
            convert_state_dict=convert_state_dict,
            tag_sources=tag_sources,
            create=create,
        )

    build.__name__ = build.__qualname__ = card.name.replace("-", "_")
    build.__doc__ = card.summary
    return register_model(card.name, card=card)(build)


def _int(key: str, v: Any, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise OverrideError(f"{key} must be an integer >= {minimum}, got {v!r}")
    return v


def int_override(key: str, doc: str, *, target: str | None = None, minimum: int = 1) -> Override:
    """An integer ≥ ``minimum`` passed to timm as ``target`` (default: the same name)."""
    return Override(doc, lambda v: {target or key: _int(key, v, minimum)})


def float_override(key: str, doc: str, *, lo: float = 0.0, hi: float = 1.0, target: str | None = None) -> Override:
    """A number in [lo, hi] passed to timm as ``target`` (default: the same name)."""

    def to_kwargs(v: Any) -> dict[str, Any]:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
            raise OverrideError(f"{key} must be a number in [{lo}, {hi}], got {v!r}")
        return {target or key: float(v)}

    return Override(doc, to_kwargs)


def int_list_override(key: str, length: int, doc: str) -> Override:
    """A list of ``length`` positive integers, passed to timm under the same name."""

    def to_kwargs(v: Any) -> dict[str, Any]:
        if (
            not isinstance(v, (list, tuple))
            or len(v) != length
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 1 for i in v)
        ):
            raise OverrideError(f"{key} must be a list of {length} positive integers, got {v!r}")
        return {key: list(v)}

    return Override(doc, to_kwargs)


def stage_width_override(doc: str) -> Override:
    """``width`` w → timm's ``channels`` [w, 2w, 4w, 8w] (ResNet stages)."""
    return Override(doc, lambda v: {"channels": [_int("width", v) * m for m in (1, 2, 4, 8)]})


def bool_override(key: str, doc: str) -> Override:
    """True or False, passed to timm under the same name."""

    def to_kwargs(v: Any) -> dict[str, Any]:
        if not isinstance(v, bool):
            raise OverrideError(f"{key} must be True or False, got {v!r}")
        return {key: v}

    return Override(doc, to_kwargs)


def choice_override(key: str, doc: str, choices: tuple) -> Override:
    """One of ``choices`` (compared by value and type), passed to timm under the same name."""

    def to_kwargs(v: Any) -> dict[str, Any]:
        if isinstance(v, bool) or not any(type(v) is type(c) and v == c for c in choices):
            raise OverrideError(f"{key} must be one of {', '.join(map(repr, choices))}; got {v!r}")
        return {key: v}

    return Override(doc, to_kwargs)


def out_indices_override(doc: str) -> Override:
    """timm's ``out_indices``: distinct feature-map indices ≥ 0, or an integer n ≥ 1 (the last n)."""

    def to_kwargs(v: Any) -> dict[str, Any]:
        if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
            return {"out_indices": v}
        if (
            isinstance(v, (list, tuple))
            and v
            and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v)
            and len(set(v)) == len(v)
        ):
            return {"out_indices": tuple(v)}
        raise OverrideError(f"out_indices must be distinct integers >= 0 (a list) or an integer n >= 1, got {v!r}")

    return Override(doc, to_kwargs)


def dict_override(key: str, doc: str) -> Override:
    """A dict with string keys, passed to timm under the same name."""

    def to_kwargs(v: Any) -> dict[str, Any]:
        if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
            raise OverrideError(f"{key} must be a dict with string keys, got {v!r}")
        return {key: dict(v)}

    return Override(doc, to_kwargs)


def str_override(key: str, doc: str) -> Override:
    """A string passed to timm under the same name (timm checks its value)."""

    def to_kwargs(v: Any) -> dict[str, Any]:
        if not isinstance(v, str):
            raise OverrideError(f"{key} must be a string, got {v!r}")
        return {key: v}

    return Override(doc, to_kwargs)


def num_classes_override() -> Override:
    """The classifier size of a timm image entry: a new head when it differs from the checkpoint's."""
    return int_override(
        "num_classes",
        "classifier outputs (default 1000); a new head when it differs from the checkpoint's; 0: no classifier "
        "(pooled features, timm's convention)",
        minimum=0,
    )


def common_timm_overrides(pools: str, *, features: bool = True) -> dict[str, Override]:
    """The overrides timm entries share: pooling, ``pretrained_cfg_overlay`` and, with ``features``,
    timm's feature extraction (``pools``: the card's list of global_pool values)."""
    table = {
        "global_pool": str_override("global_pool", f"timm's pooling before the classifier: {pools}"),
        "pretrained_cfg_overlay": dict_override(
            "pretrained_cfg_overlay", "timm's overrides of the pretrained config (with pretrained=True)"
        ),
    }
    if features:
        table["features_only"] = bool_override(
            "features_only",
            "return timm's list of feature maps instead of logits (classifier removed; GroupNorm, biases and "
            "out-of-place ops as usual; per-sample gradients exact for any loss on the maps)",
        )
        table["out_indices"] = out_indices_override(
            "with features_only: which feature maps (indices, or n for the last n; default timm's)"
        )
    return table
