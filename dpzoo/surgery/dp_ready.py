"""One call that makes any ``nn.Module`` DP-ready, and a check that says what is not."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .bias import add_missing_biases, missing_biases
from .groupnorm import GroupSpec, convert_batchnorm
from .inplace import BLOCK_SWAPS, disable_inplace
from .tied import TiedGroup, find_tied_parameters

__all__ = ["make_dp_ready", "check_dp_ready", "PatchReport", "patch_report"]


@dataclass
class PatchReport:
    """What :func:`make_dp_ready` changed. Stored on the model as ``model.dpzoo_patch_report``."""

    groupnorm: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (channels, groups)
    biases_added: list[str] = field(default_factory=list)
    norms_replaced: list[str] = field(default_factory=list)
    inplace_switched_off: list[str] = field(default_factory=list)
    blocks_swapped: list[str] = field(default_factory=list)
    tied_groups: list[TiedGroup] = field(default_factory=list)
    not_patched: dict[str, str] = field(default_factory=dict)
    options: dict = field(default_factory=dict)
    position_ids_per_sample: bool = False

    def to_dict(self) -> dict:
        return {
            "options": dict(self.options),
            "groupnorm": {k: list(v) for k, v in self.groupnorm.items()},
            "biases_added": list(self.biases_added),
            "norms_replaced": list(self.norms_replaced),
            "inplace_switched_off": list(self.inplace_switched_off),
            "blocks_swapped": list(self.blocks_swapped),
            "tied_groups": [g.to_dict() for g in self.tied_groups],
            "not_patched": dict(self.not_patched),
            "position_ids_per_sample": self.position_ids_per_sample,
        }

    def lines(self) -> list[str]:
        out = []
        if self.groupnorm:
            out.append(f"BatchNorm -> GroupNorm: {len(self.groupnorm)} layers (affine γ, β copied)")
        if self.biases_added:
            out.append(
                f"zero biases added (BiTFiT-Add): {len(self.biases_added)} layers"
                if self.options.get("bias_init", "zero") == "zero"
                else f"random biases added (BiTFiT-Add): {len(self.biases_added)} layers"
            )
        if self.norms_replaced:
            out.append(f"RMSNorm -> dpzoo.nn.RMSNorm with bias: {len(self.norms_replaced)} layers")
        if self.inplace_switched_off or self.blocks_swapped:
            out.append(
                f"in-place ops removed: {len(self.inplace_switched_off)} modules, "
                f"{len(self.blocks_swapped)} residual blocks"
            )
        for g in self.tied_groups:
            out.append("tied: " + " = ".join(g.names))
        if self.position_ids_per_sample:
            out.append("position ids passed per sample (B, T)")
        for name, why in self.not_patched.items():
            out.append(f"not patched: {name}: {why}")
        return out


def make_dp_ready(
    model: nn.Module,
    *,
    groupnorm: bool = True,
    gn_groups: GroupSpec = "auto",
    add_bias: bool = True,
    bias_exempt: Iterable[str] = (),
    bias_init: str = "zero",
    bias_std: float = 1e-3,
    bias_seed: int | None = None,
    norm_bias: bool = True,
    fix_inplace: bool = True,
) -> nn.Module:
    """Patch ``model`` for DP training; works on any ``nn.Module``, not only zoo entries.

    1. BatchNorm → GroupNorm with γ, β copied (:func:`dpzoo.surgery.convert_batchnorm`).
    2. BiTFiT-Add: zero biases where missing (:func:`dpzoo.surgery.add_missing_biases`).
    3. No in-place ops that break backward hooks (:func:`dpzoo.surgery.disable_inplace`).
    4. Tied parameters recorded (:func:`dpzoo.surgery.find_tied_parameters`).

    Returns the patched model (the same object, unless the model is itself a BatchNorm)
    with ``model.dpzoo_patch_report`` describing every change.
    """
    bias_exempt = tuple(bias_exempt)
    report = PatchReport(
        options={
            "groupnorm": groupnorm,
            "gn_groups": gn_groups if not callable(gn_groups) else "callable",
            "add_bias": add_bias,
            "bias_exempt": list(bias_exempt),
            "bias_init": bias_init,
            "bias_std": bias_std,
            "norm_bias": norm_bias,
            "fix_inplace": fix_inplace,
        }
    )
    if groupnorm:
        model, nr = convert_batchnorm(model, gn_groups)
        report.groupnorm = nr.converted
    if add_bias:
        br = add_missing_biases(
            model, exclude=bias_exempt, init=bias_init, std=bias_std, norms=norm_bias, seed=bias_seed
        )
        report.biases_added, report.norms_replaced = br.added, br.replaced_norms
        report.not_patched.update(br.not_patched)
    if fix_inplace:
        ir = disable_inplace(model)
        report.inplace_switched_off, report.blocks_swapped = ir.switched_off, ir.swapped_blocks
    report.tied_groups = find_tied_parameters(model)
    prev = getattr(model, "dpzoo_patch_report", None)
    if isinstance(prev, PatchReport):  # patching twice: keep the history of both passes
        report.groupnorm = {**prev.groupnorm, **report.groupnorm}
        report.biases_added = prev.biases_added + report.biases_added
        report.norms_replaced = prev.norms_replaced + report.norms_replaced
        report.inplace_switched_off = prev.inplace_switched_off + report.inplace_switched_off
        report.blocks_swapped = prev.blocks_swapped + report.blocks_swapped
    model.dpzoo_patch_report = report
    return model


def patch_report(model: nn.Module) -> PatchReport | None:
    return getattr(model, "dpzoo_patch_report", None)


def check_dp_ready(model: nn.Module, *, bias_exempt: Iterable[str] = (), require_bias: bool = True) -> list[str]:
    """Problems that stop ``model`` from being trained with DP-SGD / DP-BiTFiT; [] if none."""
    problems = []
    for name, m in model.named_modules():
        if isinstance(m, _BatchNorm):
            problems.append(
                f"{name or '<root>'}: {type(m).__name__} mixes samples; convert with dpzoo.make_dp_ready(model)"
            )
        if isinstance(getattr(m, "inplace", None), bool) and m.inplace:
            problems.append(f"{name}: {type(m).__name__}(inplace=True) breaks backward hooks")
    for name, m in model.named_modules():
        if type(m) in BLOCK_SWAPS:
            problems.append(f"{name}: {type(m).__name__} adds its shortcut in place")
    if require_bias:
        for name in missing_biases(model, bias_exempt):
            problems.append(f"{name}: no bias (DP-BiTFiT would not train it); dpzoo.make_dp_ready adds a zero one")
    return problems
