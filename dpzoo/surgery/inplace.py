"""Remove in-place operations that break autograd backward hooks, and find any left.

Backward hooks (``register_full_backward_hook``, used by Opacus and by dpzoo's norm
hooks) wrap a module's output in a view; an in-place op on it afterwards raises
"Output 0 of BackwardHookFunction is a view and is being modified inplace". dpzoo sets
``inplace=False`` on every module that has the switch (ReLU, Dropout, timm activations,
LayerScale, ...) and swaps timm's ResNet blocks (``x += shortcut``) for out-of-place
subclasses. :func:`find_inplace_ops` runs a forward pass and lists any in-place op left
on a tensor that autograd tracks, with the module it happened in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from timm.models.resnet import BasicBlock, Bottleneck
from torch import nn
from torch.overrides import TorchFunctionMode

from ..nn.resnet_blocks import DPBasicBlock, DPBottleneck

__all__ = ["disable_inplace", "find_inplace_ops", "InplaceReport", "InplaceOp"]


@dataclass
class InplaceReport:
    switched_off: list[str] = field(default_factory=list)  # modules whose `inplace` was True
    swapped_blocks: list[str] = field(default_factory=list)  # modules given an out-of-place class


# timm's ResNet blocks add the residual in place; the dpzoo subclasses do it out of place.
BLOCK_SWAPS: dict[type, type] = {BasicBlock: DPBasicBlock, Bottleneck: DPBottleneck}


def disable_inplace(model: nn.Module) -> InplaceReport:
    """Make ``model`` safe for backward hooks, in place. Returns what was changed."""
    report = InplaceReport()
    for name, m in model.named_modules():
        if isinstance(getattr(m, "inplace", None), bool) and m.inplace:
            m.inplace = False
            report.switched_off.append(name)
        new_cls = BLOCK_SWAPS.get(type(m))
        if new_cls is not None:
            m.__class__ = new_cls
            report.swapped_blocks.append(name)
    return report


@dataclass(frozen=True)
class InplaceOp:
    module: str  # innermost module running when the op happened ("" = the root)
    op: str

    def __str__(self) -> str:
        return f"{self.op} in module {self.module or '<root>'}"


class _InplaceRecorder(TorchFunctionMode):
    def __init__(self, stack: list[str]):
        super().__init__()
        self.stack = stack
        self.found: list[InplaceOp] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        inplace = (
            (name.endswith("_") and not name.endswith("__") and not name.startswith("_"))
            or name in ("__iadd__", "__isub__", "__imul__", "__itruediv__", "__setitem__")
            or kwargs.get("inplace") is True
            or "out" in kwargs
        )
        if inplace and name not in ("requires_grad_", "retain_grad"):
            target = args[0] if args else kwargs.get("out")
            if isinstance(target, torch.Tensor) and (target.requires_grad or target.grad_fn is not None):
                self.found.append(InplaceOp(self.stack[-1] if self.stack else "", name))
        return func(*args, **kwargs)


def find_inplace_ops(model: nn.Module, *args, **kwargs) -> list[InplaceOp]:
    """Run ``model(*args, **kwargs)`` and return the in-place ops on autograd-tracked tensors."""
    stack: list[str] = []
    handles = []

    def enter(name):
        def hook(module, inputs):
            stack.append(name)  # returns None: the inputs are left as they are

        return hook

    def leave(module, inputs, output):
        stack.pop()  # must return None, or the hook would replace the module's output

    for name, m in model.named_modules():
        handles.append(m.register_forward_pre_hook(enter(name)))
        handles.append(m.register_forward_hook(leave))
    recorder = _InplaceRecorder(stack)
    try:
        with recorder:
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return recorder.found
