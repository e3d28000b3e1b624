"""One call that makes any ``nn.Module`` DP-ready, and a check that says what is not."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from torch import nn

from ..grad_norms.plan import find_problems
from .bias import add_missing_biases, missing_biases
from .groupnorm import GroupSpec, convert_batchnorm
from .inplace import disable_inplace
from .layers import replace_layers
from .layerscale import move_layer_scales
from .tied import TiedGroup, find_tied_parameters

__all__ = ["make_dp_ready", "check_dp_ready", "PatchReport", "patch_report"]


@dataclass
class PatchReport:
    """What :func:`make_dp_ready` changed. Stored on the model as ``model.dpzoo_patch_report``."""

    groupnorm: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (channels, groups)
    layers_replaced: dict[str, str] = field(default_factory=dict)  # name -> "LSTM -> DPLSTM"
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
            "layers_replaced": dict(self.layers_replaced),
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
        for name, what in self.layers_replaced.items():
            out.append(f"{what} (weights copied, same outputs): {name}")
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
    swap_layers: bool = True,
) -> nn.Module:
    """Patch ``model`` for DP training; works on any ``nn.Module``, not only zoo entries.

    1. BatchNorm → GroupNorm with γ, β copied (:func:`dpzoo.surgery.convert_batchnorm`).
    2. ``nn.MultiheadAttention`` / ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` → dpzoo's DP-ready equivalents
       built from ``nn.Linear``, weights copied (:func:`dpzoo.surgery.replace_layers`); a timm
       ConvNeXt block's loose layer scale moved into a module (:mod:`dpzoo.surgery.layerscale`).
    3. BiTFiT-Add: zero biases where missing (:func:`dpzoo.surgery.add_missing_biases`).
    4. No in-place ops that break backward hooks (:func:`dpzoo.surgery.disable_inplace`).
    5. Tied parameters recorded (:func:`dpzoo.surgery.find_tied_parameters`).

    Returns the patched model (the same object, unless the model is itself a BatchNorm or one of
    the replaced layers) with ``model.dpzoo_patch_report`` describing every change.
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
            "swap_layers": swap_layers,
        }
    )
    if groupnorm:
        model, nr = convert_batchnorm(model, gn_groups)
        report.groupnorm = nr.converted
    if swap_layers:
        model, lr = replace_layers(model)
        report.layers_replaced = lr.replaced
        report.not_patched.update(lr.not_patched)
        moved, left = move_layer_scales(model)
        report.layers_replaced.update(moved)
        report.not_patched.update(left)
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
        report.layers_replaced = {**prev.layers_replaced, **report.layers_replaced}
        report.biases_added = prev.biases_added + report.biases_added
        report.norms_replaced = prev.norms_replaced + report.norms_replaced
        report.inplace_switched_off = prev.inplace_switched_off + report.inplace_switched_off
        report.blocks_swapped = prev.blocks_swapped + report.blocks_swapped
    model.dpzoo_patch_report = report
    return model


def patch_report(model: nn.Module) -> PatchReport | None:
    return getattr(model, "dpzoo_patch_report", None)


def check_dp_ready(model: nn.Module, *, bias_exempt: Iterable[str] = (), require_bias: bool = False) -> list[str]:
    """Why dpzoo's engine would refuse ``model`` as it is, one line per problem
    (``"name: what is wrong and how to fix it"``); [] iff ``dpzoo.PrivacyEngine().make_private`` and
    the hooks' first forward accept it (with its current ``requires_grad`` flags and train/eval modes).

    The problems are :func:`dpzoo.grad_norms.plan.find_problems`, the list the hooks and the engine
    refuse from. ``require_bias=True`` also lists Conv/Linear/MultiheadAttention layers and affine
    norms without a bias (outside ``bias_exempt`` patterns): DP-BiTFiT advice, not a refusal
    (``make_dp_ready`` adds zero biases)."""
    problems = [str(p) for p in find_problems(model)]
    if require_bias:
        for name in missing_biases(model, bias_exempt):
            problems.append(f"{name}: no bias (DP-BiTFiT would not train it); dpzoo.make_dp_ready adds a zero one")
    return problems
