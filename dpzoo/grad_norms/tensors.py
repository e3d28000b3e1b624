"""Tensors in a hooked layer's calls: the ones in a model's output, a layer's first input, the
tensor whose gradient is a layer output's (robust to in-place ops on the output), and whether
autograd is running a backward pass."""

from __future__ import annotations

import torch
from torch.nn.modules import module as torch_module

__all__ = ["output_tensors", "first_tensor", "gradient_source", "hooks_ahead", "in_backward"]


def output_tensors(output, grad_only: bool = True) -> list[torch.Tensor]:
    """The tensors in a model's output that have a gradient path (all tensors with
    ``grad_only=False``), inside tensors, tuples, lists, dicts and transformers' ModelOutputs, in a
    fixed order: two calls on outputs of the same structure list corresponding tensors at the same
    positions."""
    found, stack = [], [output]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            if o.grad_fn is not None or not grad_only:
                found.append(o)
        elif isinstance(o, dict):
            stack.extend(reversed(list(o.values())))
        elif isinstance(o, (list, tuple)):
            stack.extend(reversed(o))
    return found


def first_tensor(args) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    return None


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def gradient_source(output: torch.Tensor, inputs: tuple) -> torch.Tensor:
    """The tensor whose gradient is a layer output's gradient, taken where an in-place op on the
    output cannot hide it. A layer output that is a whole reshape of a tensor the layer made
    (``F.linear`` on a 3-d input returns a view of its 2-d product since torch 2.14) loses its
    autograd node when modified in place (``h[:, 0] = 0`` rebases the view's history onto its base),
    and a hook on it never fires; the base's node stays in the graph and receives the gradient
    of the output's value before the in-place op, which is what the layer's rule needs."""
    base = output._base
    if (
        base is None
        or base.grad_fn is None
        or base.numel() != output.numel()
        or base.storage_offset() != output.storage_offset()
        or not (base.is_contiguous() and output.is_contiguous())
        or any(isinstance(a, torch.Tensor) and (a is base or a._base is base) for a in inputs)
    ):
        return output
    return base


def hooks_ahead(module: torch.nn.Module, first: int | None) -> list[str]:
    """The forward hooks torch runs on ``module`` before dpzoo's (whose handle id is ``first``):
    global forward hooks other than torch's own bookkeeping (``torch.distributed._tools``' module
    tracker, used by FlopCounterMode), then module hooks registered ahead of it with prepend=True."""
    ahead = [
        getattr(h, "__qualname__", repr(h))
        for h in torch_module._global_forward_hooks.values()
        if not getattr(h, "__module__", "").startswith("torch.")
    ]
    for key, h in module._forward_hooks.items():
        if key == first:
            break
        ahead.append(getattr(h, "__qualname__", repr(h)))
    return ahead
