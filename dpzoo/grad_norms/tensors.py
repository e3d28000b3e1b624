"""Tensors in a hooked layer's calls: the ones in a model's output, a layer's first input, the
tensor whose gradient is a layer output's (robust to in-place ops on the output), and whether
autograd is running a backward pass; the forward hooks that run before dpzoo's, refused."""

from __future__ import annotations

import torch
from torch.nn.modules import module as torch_module

from ..errors import UnsupportedModuleError

__all__ = [
    "output_tensors",
    "first_tensor",
    "gradient_source",
    "view_of",
    "as_output",
    "on_gradient",
    "hooks_ahead",
    "refuse_hooks_ahead",
    "in_backward",
]


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
    output cannot hide it. A layer output that is a whole reshape or permutation of a tensor the layer
    made (``F.linear`` on a 3-d input returns a view of its 2-d product since torch 2.14; timm's
    LayerNorm2d a permuted one) loses its autograd node when modified in place (``h[:, 0] = 0``
    rebases the view's history onto its base): a hook on it never fires, or sees only what read it
    before the edit (a review found LayerNorm2d's norms 8-22% low on 2026-11-28, permuted views being
    hooked as themselves). The base's node stays in the graph and receives the gradient of the
    output's value before the in-place op, which is what the layer's rule needs; :func:`as_output`
    gives it the output's shape and layout."""
    base = output._base
    if (
        base is None
        or base.grad_fn is None
        or base.numel() != output.numel()
        or base.storage_offset() != output.storage_offset()
        or not (base.is_contiguous() and _dense(output))
    ):
        return output
    for a in inputs:  # a loop, not any(...): a generator is a frame per input, every hooked call
        if isinstance(a, torch.Tensor) and (a is base or a._base is base):
            return output
    return base


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers its numel consecutive storage entries once each (a permutation of a
    contiguous layout): its strides, sorted, are those of a contiguous tensor of the sorted sizes."""
    expected = 1
    for stride, size in sorted([(st, n) for n, st in zip(t.shape, t.stride()) if n != 1]):
        if stride != expected:
            return False
        expected *= size
    return True


def view_of(output: torch.Tensor, source: torch.Tensor) -> tuple | None:
    """What :func:`as_output` needs to turn ``source``'s gradient into ``output``'s (None: the same tensor)."""
    return None if source is output else (tuple(output.shape), tuple(output.stride()))


def as_output(grad: torch.Tensor, view: tuple | None) -> torch.Tensor:
    """The gradient of a layer's output from that of its :func:`gradient_source` (``view``: from
    :func:`view_of`): the base's gradient laid out as the base, read with the output's strides."""
    if view is None:
        return grad
    shape, stride = view
    return grad.contiguous().as_strided(shape, stride)


def on_gradient(t: torch.Tensor, fn) -> None:
    """Call ``fn(grad)`` each time a backward reaches ``t``, with the gradient autograd then uses for
    ``t``'s value: a pre-hook on ``t``'s autograd node, which torch runs after every hook registered
    on the tensor (a model's ``h.register_hook(lambda g: 3 * g)`` is part of the gradient the layer's
    parameters get; a tensor hook registered before it saw the unscaled gradient, found by a review
    on 2026-11-28); a tensor hook on a leaf."""
    node = t.grad_fn
    if node is None:
        t.register_hook(fn)
        return
    nr = t.output_nr

    def pre(grad_outputs):
        if grad_outputs[nr] is not None:
            fn(grad_outputs[nr])

    node.register_prehook(pre)


def hooks_ahead(module: torch.nn.Module, first: int | None) -> list[str]:
    """The forward hooks torch runs on ``module`` before dpzoo's (whose handle id is ``first``):
    global forward hooks other than torch's own bookkeeping (``torch.distributed._tools``' module
    tracker, used by FlopCounterMode), then module hooks registered ahead of it with prepend=True."""
    hooks = module._forward_hooks
    ahead = [
        getattr(h, "__qualname__", repr(h))
        for h in torch_module._global_forward_hooks.values()
        if not getattr(h, "__module__", "").startswith("torch.")
    ]
    for key, h in hooks.items():
        if key == first:
            break
        ahead.append(getattr(h, "__qualname__", repr(h)))
    return ahead


def refuse_hooks_ahead(name: str, module: torch.nn.Module, first: int | None) -> None:
    """Raise if forward hooks run on ``module`` (planned as ``name``) before dpzoo's (handle id ``first``)."""
    if not torch_module._global_forward_hooks and next(iter(module._forward_hooks), None) == first:
        return  # the usual case, once per hooked call: no list built, no call
    ahead = hooks_ahead(module, first)
    if ahead:  # they may have edited the output in place: its gradient would be the edited value's
        raise UnsupportedModuleError(
            f"Forward hook(s) {', '.join(ahead)} run on {name} ({type(module).__name__}) before "
            "dpzoo's (a global hook, or one registered with prepend=True after dpzoo attached): an edit "
            "they make to the output would hide the layer's own output from dpzoo. Register them "
            "without prepend=True, or on the module's parent; dpzoo's own (CopyInert) are another "
            "engine's, still attached to a layer reused from its model: engine.detach() first."
        )
