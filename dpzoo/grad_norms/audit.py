"""The graph audit: every use of a trainable parameter in a step must be one dpzoo recorded.

* edge counting: :func:`count_edges` counts the direct uses of every parameter in the autograd
  graph of the loss (or of the model's outputs), :func:`compare_uses` compares them with the
  recorded uses (a parameter used outside its module, e.g. ``x @ module.weight``, is refused);
* stray gradients: with ``ghost_backward`` no weight gradient is ever computed, so one reaching
  a parameter (:func:`stray_grad_hook`) comes from a use dpzoo cannot see;
* version checks: an activation modified in place after its layer used it (:func:`check_versions`).

:func:`check_step` runs the checks still due before a step's records are assembled.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.autograd.graph import GradientEdge

from ..errors import PrivacyUsageError, UnsupportedModuleError
from .capture import Recorder, Step, Use
from .sharded import aliases_of, planned

__all__ = ["count_edges", "compare_uses", "stray_grad_hook", "check_versions", "check_step"]

# a type test, not getattr(node, "variable", None): every other node raises inside getattr (~13%
# of the walk over a 22-layer llama's 1,598 nodes)
_ACCUMULATE = torch._C._functions.AccumulateGrad


def count_edges(step: Step, roots: list) -> None:
    """Count the direct uses of every trainable parameter in the graph of ``roots`` (added to
    the counts of graphs walked before in this step; shared nodes are walked once)."""
    if roots and all(r.grad_fn is None for r in roots):
        raise PrivacyUsageError(
            "loss does not require grad: did the forward pass run under torch.no_grad()? Run it with grad enabled."
        )
    edges: dict[int, int] = step.edges if step.edges is not None else {}
    # id -> node: holding the node keeps its id from being reused by another node's Python wrapper,
    # which torch frees when nothing refers to it (before 2.13 a new wrapper per access: a reused
    # id made the walk stop early and miss parameter uses)
    walked: dict = step.walked if step.walked is not None else {}
    stack = [r.grad_fn for r in roots]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in walked:
            continue
        walked[id(fn)] = fn
        if type(fn).__name__ == "CheckpointFunctionBackward":  # ghost differentiation refuses it (ghost.py)
            step.reentrant_checkpoint = True
        for nxt, _ in fn.next_functions:
            if nxt is None:
                continue
            if type(nxt) is _ACCUMULATE:  # a leaf's node (the one holding ``variable``): a direct use
                key = id(nxt.variable)
                edges[key] = edges.get(key, 0) + 1
            else:
                stack.append(nxt)
    step.edges, step.walked = edges, walked


def compare_uses(step: Step, params: dict[str, nn.Parameter]) -> None:
    """Every direct use of a trainable parameter must be one dpzoo recorded."""
    if step.edges is None:
        return
    recorded: dict[int, int] = {}
    per_task: dict[tuple, int] = {}  # activation-free uses: (parameter, backward pass) -> count
    aliases = step.aliases  # FSDP2's stand-ins; empty otherwise (no lookup per use then)
    for u in step.uses:
        if u.loose:
            continue
        edge: GradientEdge | None = u.edge  # type: ignore[assignment]
        if edge is not None and id(edge.node) not in step.walked:
            continue  # this call's output does not reach the loss
        for n in u.params:
            p = getattr(u.module, n)
            pid = id(planned(aliases, p) if aliases else p)  # FSDP2's stand-in counts as the parameter
            if u.edge is None:  # one use per module call per backward pass
                per_task[pid, u.task] = per_task.get((pid, u.task), 0) + 1
            else:
                recorded[pid] = recorded.get(pid, 0) + 1
    calls: dict[int, int] = {}
    for (pid, _), k in per_task.items():  # several backward passes replay the same calls
        calls[pid] = max(calls.get(pid, 0), k)
    for pid, k in calls.items():
        recorded[pid] = recorded.get(pid, 0) + k
    for name, p in params.items():
        used = step.edges.get(id(p), 0)
        if aliases:
            used += sum(step.edges.get(id(a), 0) for a in aliases_of(aliases, p))
        if used > recorded.get(id(p), 0):
            raise UnsupportedModuleError(
                f"Parameter {name} is used {used} time(s) in this step but dpzoo recorded "
                f"{recorded.get(id(p), 0)}: it is used outside the module that owns it (e.g. `x @ "
                "module.weight` in another module's forward, or in the loss). Its per-sample gradient "
                "cannot be accounted for; route every use through a module, or freeze it."
            )
    step.graph_checked = True


def stray_grad_hook(rec: Recorder, name: str):
    """A tensor hook for parameter ``name``: notes a gradient computed outside ghost differentiation.

    It holds the recorder weakly: a hook on a parameter is owned by the C++ tensor, which Python's
    garbage collector cannot see through, so a strong reference would make parameter → hook →
    recorder → step → stored activations → module → parameter an uncollectable cycle. Ordinarily the
    step's end clears the activations; after a backward that failed (out of memory, say) they
    stayed alive even once the model and engine were deleted."""
    rec_ref = weakref.ref(rec)

    def hook(grad):
        rec = rec_ref()
        if rec is not None and not rec.by_edges and not rec.paused:
            rec.step.stray.append(name)
        return None

    return hook


def check_versions(use: Use) -> None:
    """Refuse a use whose stored input was modified in place after the layer used it."""
    if use.versions is None:
        return
    for a, v in zip(use.activations, use.versions):
        if isinstance(a, torch.Tensor) and v is not None and a._version != v:
            raise UnsupportedModuleError(
                f"The input of {use.module_name} was modified in place after the layer used "
                "it; its per-sample gradient would be wrong. Remove the in-place op "
                "(dpzoo.make_dp_ready switches off the usual ones)."
            )


def check_step(step: Step, params: dict[str, nn.Parameter]) -> None:
    """The checks due before assembling a step: a backward ran, no stray gradient, and every
    parameter use counted (from the model's outputs, when ``loss.backward()`` was used)."""
    if not step.backward_done:
        raise PrivacyUsageError(
            "No backward pass since the last forward: call hooks.backward(loss) or loss.backward() first."
        )
    if step.stray:
        raise UnsupportedModuleError(
            f"Parameter(s) {', '.join(dict.fromkeys(step.stray))} received a gradient outside dpzoo's ghost "
            "differentiation: they are used outside the model's forward (e.g. a weight penalty or a tied "
            "projection in the loss), so their per-sample gradient cannot be accounted for. Compute "
            "every use inside the model (or use the optimizer's weight_decay), or freeze them."
        )
    if not step.graph_checked:
        if step.outputs:  # loss.backward() was used: check from the model's outputs
            count_edges(step, step.outputs)
            compare_uses(step, params)
        elif not step.root_ran:
            raise UnsupportedModuleError(
                "Hooked layers ran, but not through the model itself (model.forward(...) or a submodule "
                "was called): dpzoo cannot check every parameter use. Call model(...), or use "
                "hooks.backward(loss)."
            )
        else:
            raise UnsupportedModuleError(
                "The model's output holds no tensor dpzoo can find (it looks inside tensors, tuples, "
                "lists and dicts), so the parameter uses behind loss.backward() cannot be checked. "
                "Use hooks.backward(loss), or return tensors in one of these containers."
            )
