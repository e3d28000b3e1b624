"""Builders for zoo entries backed by timm models."""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable

import timm
from torch import nn

from ..checkpoint import load_state_dict_checked, read_state_dict
from ..errors import CheckpointError, OverrideError
from ..registry import ModelCard, register_model
from ..surgery import make_dp_ready
from ._common import Override, OverrideTable, library_kwargs, split_patch_options

log = logging.getLogger("dpzoo")


def _create(arch: str, pretrained: bool, **kwargs) -> nn.Module:
    try:
        return timm.create_model(arch, pretrained=pretrained, **kwargs)
    except TypeError as e:  # an argument the timm architecture does not take
        raise OverrideError(f"timm's {arch.split('.')[0]} rejected the overrides {kwargs}: {e}") from None
    except (AssertionError, ValueError) as e:  # inconsistent sizes (e.g. img_size % patch_size)
        raise OverrideError(f"timm's {arch.split('.')[0]} cannot be built with {kwargs}: {e}") from None


def load_local_checkpoint(
    model: nn.Module,
    path,
    *,
    num_classes_overridden: bool,
    entry: str,
    convert_state_dict: Callable[[dict], dict] | None = None,
) -> None:
    """Load a local checkpoint file into a timm ``model``: the entry's own key mapping, then timm's
    ``checkpoint_filter_fn``, then a strict load (a new head may be missing when
    ``num_classes_overridden``)."""
    sd = read_state_dict(path)
    if convert_state_dict is not None:  # the entry's own key mapping (e.g. another library's names)
        sd = convert_state_dict(sd)
    module = sys.modules.get(type(model).__module__)
    filter_fn: Callable | None = getattr(module, "checkpoint_filter_fn", None)
    if filter_fn is not None:  # timm's own conversions (e.g. ViT position-embedding resampling)
        try:
            sd = filter_fn(sd, model)
        except Exception as e:
            raise CheckpointError(f"{path}: timm could not adapt this checkpoint to {entry} ({e}).") from None
    allow_missing = []
    classifier = (getattr(model, "pretrained_cfg", None) or {}).get("classifier")
    if classifier and num_classes_overridden:
        # timm's convention: asking for another num_classes re-initialises the head.
        expected = model.state_dict()
        head_keys = [k for k in sd if k.startswith(classifier + ".")]
        if any(k in expected and sd[k].shape != expected[k].shape for k in head_keys):
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
) -> nn.Module:
    """Build timm's ``arch``, load weights, then apply dpzoo's patches.

    ``overrides_table`` declares each user-facing override (its card text and its timm kwargs).
    ``convert_state_dict`` maps a ``weights=PATH`` state dict to timm's keys; it runs right
    after the file is read, before timm's own ``checkpoint_filter_fn``.
    """
    arch_over, patch_kw = split_patch_options(overrides, patch_defaults)
    kwargs = {**(base_kwargs or {}), **library_kwargs(entry, overrides_table, arch_over)}
    if pretrained and weights is not None:
        raise OverrideError("Pass either pretrained=True or weights=PATH, not both.")
    if pretrained:
        name = f"{arch}.{pretrained_tag}" if pretrained_tag else arch
        try:
            model = _create(name, True, **kwargs)
        except (OverrideError, CheckpointError):
            raise
        except Exception as e:  # hub unreachable, unknown tag, ...
            raise CheckpointError(
                f"timm could not fetch pretrained weights for {name!r} ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}). Offline? Download the checkpoint "
                f"where the hub is reachable and pass weights=PATH."
            ) from None
    else:
        model = _create(arch, False, **kwargs)
        if weights is not None:
            load_local_checkpoint(
                model,
                weights,
                num_classes_overridden="num_classes" in arch_over,
                entry=entry,
                convert_state_dict=convert_state_dict,
            )
    return make_dp_ready(model, **patch_kw)


def register_timm_entry(
    card: ModelCard,
    arch: str,
    *,
    default_tag: str | None,
    overrides_table: OverrideTable,
    convert_state_dict: Callable[[dict], dict] | None = None,
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
        )

    build.__name__ = build.__qualname__ = card.name.replace("-", "_")
    build.__doc__ = card.summary
    return register_model(card.name, card=card)(build)


def _int(key: str, v: Any, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise OverrideError(f"{key} must be an integer >= {minimum}, got {v!r}")
    return v


def int_override(key: str, doc: str, *, target: str | None = None) -> Override:
    """An integer ≥ 1 passed to timm as ``target`` (default: the same name)."""
    return Override(doc, lambda v: {target or key: _int(key, v)})


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
