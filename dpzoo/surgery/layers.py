"""Replace layers no per-sample rule can see into by DP-ready equivalents computing the same function.

``nn.MultiheadAttention`` hands its packed ``in_proj_weight`` and ``out_proj``'s parameters to a
functional kernel, and ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` keep every weight in one fused kernel:
dpzoo's hooks (and the engine) refuse them. :func:`replace_layers` swaps each for
:class:`~dpzoo.nn.DPMultiheadAttention`, :class:`~dpzoo.nn.DPLSTM`, :class:`~dpzoo.nn.DPGRU` or
:class:`~dpzoo.nn.DPRNN` (built from ``nn.Linear``, same arguments and outputs, weights, dtype,
device, ``requires_grad`` flags and train/eval mode copied; ``load_state_dict`` still accepts the
old keys). Only modules of exactly these classes are swapped, and only when nothing else is
attached to them (hooks, a forward replaced on the instance): a subclass may compute something
else, and hooks would be lost; those are reported, not swapped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from ..nn.attention import DPMultiheadAttention
from ..nn.hf_blocks import FLATTENING_BLOCKS, probe_mismatch
from ..nn.recurrent import DPGRU, DPLSTM, DPRNN

__all__ = ["LAYER_SWAPS", "LayerReport", "replace_layers"]

LAYER_SWAPS: dict[type, Callable[[Any], nn.Module]] = {
    nn.MultiheadAttention: DPMultiheadAttention.from_torch,
    nn.LSTM: DPLSTM.from_torch,
    nn.GRU: DPGRU.from_torch,
    nn.RNN: DPRNN.from_torch,
}


@dataclass
class LayerReport:
    replaced: dict[str, str] = field(default_factory=dict)  # name -> "LSTM -> DPLSTM"
    not_patched: dict[str, str] = field(default_factory=dict)  # name -> why not


def _why_not(m: nn.Module) -> str | None:
    if "forward" in vars(m):
        return "its forward was replaced on the instance"
    hooks = (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks)
    if any(hooks) or any(p._backward_hooks for p in m.parameters(recurse=False)):
        return "it has hooks registered, which the replacement would not carry"
    return None


def _swap(m: nn.Module, name: str, report: LayerReport, done: dict[int, nn.Module]) -> nn.Module | None:
    """The replacement of ``m`` (the same one for a module reached twice), or None."""
    if id(m) in done:
        return done[id(m)]
    batch_first = FLATTENING_BLOCKS.get(type(m))
    if batch_first is not None:  # swapped by class: every parameter (and hook) stays
        why = probe_mismatch(type(m))
        if why is not None:
            report.not_patched[name] = (
                f"dpzoo's {batch_first.__name__} does not compute what the installed transformers' "
                f"{type(m).__name__}.forward computes ({why}): not swapped"
            )
            return None
        m.__class__ = batch_first
        report.replaced[name] = f"{type(m).__mro__[1].__name__} -> {batch_first.__name__}"
        done[id(m)] = m
        return None
    make = LAYER_SWAPS.get(type(m))
    if make is None:
        base = next((t for t in LAYER_SWAPS if isinstance(m, t)), None)
        if base is not None:
            report.not_patched[name] = (
                f"{type(m).__name__} subclasses {base.__name__} and may compute something else: not replaced "
                "by dpzoo's DP-ready layer"
            )
        return None
    why = _why_not(m)
    if why:
        report.not_patched[name] = f"{type(m).__name__} not replaced: {why}"
        return None
    new = make(m)
    done[id(m)] = new
    report.replaced[name] = f"{type(m).__name__} -> {type(new).__name__}"
    return new


def replace_layers(model: nn.Module) -> tuple[nn.Module, LayerReport]:
    """Swap every ``nn.MultiheadAttention``, ``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` of ``model`` for dpzoo's
    DP-ready equivalent. Returns ``(model, report)``: the same model changed in place, unless it is
    itself such a layer (then its replacement)."""
    report = LayerReport()
    done: dict[int, nn.Module] = {}
    root = _swap(model, "<root>", report, done)
    if root is not None:
        return root, report
    for name, m in list(model.named_modules(remove_duplicate=False)):
        for child_name, child in list(m.named_children()):
            new = _swap(child, f"{name}.{child_name}" if name else child_name, report, done)
            if new is not None:
                setattr(m, child_name, new)
    return model, report
