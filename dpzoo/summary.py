"""``dpzoo.summary``: parameter counts, bias share (DP-BiTFiT Table 1), norms, ties."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from torch import nn

from .surgery.bias import BIAS_LAYER_TYPES
from .surgery.tied import TiedGroup, find_tied_parameters

__all__ = ["summary", "ModelSummary", "NORM_TYPES"]

NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.LocalResponseNorm)


def _is_norm(m: nn.Module) -> bool:
    return isinstance(m, NORM_TYPES) or type(m).__name__.lower().endswith(("norm", "norm2d", "normact2d"))


@dataclass
class ModelSummary:
    total_params: int
    trainable_params: int
    bias_params: int
    trainable_bias_params: int
    norm_layers: dict[str, int] = field(default_factory=dict)
    tied_groups: list[TiedGroup] = field(default_factory=list)
    layers_without_bias: int = 0

    @property
    def bias_percent(self) -> float:
        """Bias parameters as a percentage of all parameters (DP-BiTFiT, Table 1)."""
        return 100.0 * self.bias_params / self.total_params if self.total_params else 0.0

    def __str__(self) -> str:
        rows = [
            ("parameters", f"{self.total_params:,}"),
            ("trainable", f"{self.trainable_params:,}"),
            ("bias parameters", f"{self.bias_params:,} ({self.bias_percent:.3f}% of all)"),
            ("trainable biases", f"{self.trainable_bias_params:,}"),
            ("normalisation", ", ".join(f"{k} x{v}" for k, v in sorted(self.norm_layers.items())) or "none"),
            ("Conv/Linear without bias", str(self.layers_without_bias)),
            ("tied parameters", "; ".join(" = ".join(g.names) for g in self.tied_groups) or "none"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def summary(model: nn.Module) -> ModelSummary:
    """Count parameters once each (tied tensors once), biases, norm layers and ties.

    A "bias" is any parameter whose name ends in ``bias`` (``in_proj_bias`` included).
    Works on models built on the ``meta`` device, so full-size models cost no memory.
    """
    total = trainable = bias = tbias = 0
    for name, p in model.named_parameters():
        n = p.numel()
        total += n
        is_bias = name.rsplit(".", 1)[-1].endswith("bias")
        bias += n if is_bias else 0
        if p.requires_grad:
            trainable += n
            tbias += n if is_bias else 0
    norms = Counter(type(m).__name__ for m in model.modules() if _is_norm(m))
    no_bias = sum(1 for m in model.modules() if isinstance(m, BIAS_LAYER_TYPES) and m.bias is None)
    return ModelSummary(total, trainable, bias, tbias, dict(norms), find_tied_parameters(model), no_bias)
