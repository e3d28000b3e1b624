"""BatchNorm → GroupNorm (DP-BiTFiT paper, App. A.2).

BatchNorm mixes samples in a batch, so per-sample gradients (and DP-SGD) are undefined
for it. GroupNorm normalises each sample on its own. Unlike Opacus'
``ModuleValidator.fix`` (which drops BN's affine parameters and uses ``gcd(32, C)``
groups), dpzoo copies γ and β into the GroupNorm and never builds groups of a single
channel: with one channel per group a 1×1 feature map (or a BatchNorm1d feature) is
normalised over one value and the layer outputs a constant β.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Union

import torch
from timm.layers.norm_act import BatchNormAct2d, GroupNormAct
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..errors import PatchError

__all__ = ["convert_batchnorm", "choose_num_groups", "GroupSpec", "NormReport"]

GroupSpec = Union[str, int, Callable[[str, int], int]]


@dataclass
class NormReport:
    converted: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (C, G)


def choose_num_groups(num_channels: int, max_groups: int = 32, min_group_size: int = 2) -> int:
    """The largest G ≤ ``max_groups`` dividing C with at least ``min_group_size`` channels per group.

    ``max_groups=32`` follows GroupNorm's paper default; ``min_group_size=2`` rules out
    instance-norm-like groups of one channel. C=1 gives G=1.
    """
    if num_channels < 1:
        raise PatchError(f"num_channels must be >= 1, got {num_channels}")
    for g in range(min(max_groups, num_channels), 0, -1):
        if num_channels % g == 0 and (num_channels // g >= min_group_size or g == 1):
            return g
    return 1


def _groups_for(spec: GroupSpec, name: str, channels: int) -> int:
    if spec == "auto":
        g = choose_num_groups(channels)
    elif callable(spec):
        g = spec(name, channels)
    elif isinstance(spec, int) and not isinstance(spec, bool):
        g = spec
    else:
        raise PatchError(f"gn_groups must be 'auto', an int or a callable(name, channels) -> int; got {spec!r}")
    if not isinstance(g, int) or g < 1 or channels % g != 0:
        divisors = [d for d in range(1, min(channels, 64) + 1) if channels % d == 0]
        raise PatchError(
            f"Cannot convert {name!r} to GroupNorm with {g!r} groups: {channels} channels are not "
            f"divisible by it. Divisors of {channels} include {divisors}; pass gn_groups='auto' "
            "or a callable(name, channels) -> groups."
        )
    return g


def _group_norm_like(bn: _BatchNorm, groups: int) -> nn.Module:
    c, dev = bn.num_features, (bn.weight.device if bn.weight is not None else None)
    dtype = bn.weight.dtype if bn.weight is not None else None
    if isinstance(bn, BatchNormAct2d):  # timm's fused BatchNormAct2d: keep its activation and dropout
        gn = GroupNormAct(c, num_groups=groups, eps=bn.eps, affine=bn.affine, apply_act=False, device=dev, dtype=dtype)
        gn.act, gn.drop = bn.act, bn.drop
    else:
        gn = nn.GroupNorm(groups, c, eps=bn.eps, affine=bn.affine, device=dev, dtype=dtype)
    if bn.affine:
        with torch.no_grad():
            if bn.weight.device.type != "meta":
                gn.weight.copy_(bn.weight)
                gn.bias.copy_(bn.bias)
        gn.weight.requires_grad_(bn.weight.requires_grad)
        gn.bias.requires_grad_(bn.bias.requires_grad)
    gn.train(bn.training)
    return gn


def convert_batchnorm(model: nn.Module, gn_groups: GroupSpec = "auto") -> tuple[nn.Module, NormReport]:
    """Replace every BatchNorm{1,2,3}d / SyncBatchNorm (and timm BatchNormAct2d) by GroupNorm.

    Returns ``(model, report)``; the model is changed in place unless it is itself a
    BatchNorm, in which case the returned module replaces it.
    """
    report = NormReport()
    if isinstance(model, _BatchNorm):
        g = _groups_for(gn_groups, "", model.num_features)
        report.converted[""] = (model.num_features, g)
        return _group_norm_like(model, g), report
    for name, m in list(model.named_modules()):
        for child_name, child in list(m.named_children()):
            if isinstance(child, _BatchNorm):
                full = f"{name}.{child_name}" if name else child_name
                g = _groups_for(gn_groups, full, child.num_features)
                setattr(m, child_name, _group_norm_like(child, g))
                report.converted[full] = (child.num_features, g)
    return model, report
