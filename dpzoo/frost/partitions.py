"""Parameter partitions for DP-FROST (§4.3): by default one per module that owns trainable
parameters, i.e. a weight matrix together with its bias (LayerNorm's scale with its shift)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from torch import nn

from ..errors import DPZooError

__all__ = ["Partition", "default_partitions", "resolve_partitions"]


@dataclass(frozen=True)
class Partition:
    name: str
    params: tuple[str, ...]  # names as in model.named_parameters() (a tied tensor once)
    size: int


def _trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def default_partitions(model: nn.Module, exclude: Iterable[str] = ()) -> list[Partition]:
    """One partition per owning module (weight + bias), in model order; ``exclude``d names skipped."""
    skip = set(exclude)
    groups: dict[str, list[str]] = {}
    for name in _trainable(model):
        if name in skip:
            continue
        owner = name.rsplit(".", 1)[0] if "." in name else name  # a root-level tensor is its own partition
        groups.setdefault(owner, []).append(name)
    params = _trainable(model)
    return [Partition(owner, tuple(names), sum(params[n].numel() for n in names)) for owner, names in groups.items()]


def resolve_partitions(model: nn.Module, partitions, exclude: Iterable[str] = ()) -> list[Partition]:
    """Validate user partitions (a mapping label → parameter names, or a list of name lists):
    disjoint, trainable, and together with ``exclude`` covering every trainable parameter, so no
    parameter is trained unselected or selected unaccounted."""
    if partitions is None:
        return default_partitions(model, exclude)
    items = (
        list(partitions.items())
        if isinstance(partitions, Mapping)
        else [(",".join(names), names) for names in partitions]
    )
    params = _trainable(model)
    seen: dict[str, str] = {n: "<always trained>" for n in exclude}
    out = []
    for label, names in items:
        names = tuple(names)
        if not names:
            raise DPZooError(f"partition {label!r} is empty")
        for n in names:
            if n not in params:
                raise DPZooError(
                    f"partition {label!r}: {n!r} is not a trainable parameter of the model "
                    f"(names as in model.named_parameters())"
                )
            if n in seen:
                raise DPZooError(
                    f"parameter {n!r} is in two partitions ({seen[n]!r} and {label!r}); they must be disjoint"
                )
            seen[n] = label
        out.append(Partition(str(label), names, sum(params[n].numel() for n in names)))
    missing = [n for n in params if n not in seen]
    if missing:
        raise DPZooError(
            f"trainable parameters in no partition: {', '.join(missing[:8])}"
            f"{' …' if len(missing) > 8 else ''}. Add them to a partition, to always_train, or "
            "freeze them (requires_grad=False) before selecting."
        )
    return out
