"""Ghost differentiation (BK paper, Algorithm 1): back-propagate only to the hooked layers.

:func:`ghost_differentiate` asks autograd for the output gradients of the hooked layers (and
the gradients of bias-only layers, through their output-gradient hooks), never for a weight gradient,
so ``.grad`` is left alone. With ``ghost_backward=True``, :func:`wrap_outputs` hands the user
model outputs cut from the model graph whose backward (:class:`GhostBackward`) runs it, so a
plain ``loss.backward()`` is ghost differentiation. Each pass is audited
(:mod:`dpzoo.grad_norms.audit`).
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch

from ..errors import PrivacyUsageError, UnsupportedModuleError
from .audit import compare_uses, count_edges
from .capture import Recorder
from .loss_pool import check_watched
from .plan import ModelPlan
from .sample_rows import SampleRows, State, tag, track
from .sharded import aliases_of, is_dtensor
from .tensors import as_output

__all__ = ["GhostBackward", "wrap_outputs", "ghost_differentiate"]


class GhostBackward(torch.autograd.Function):
    """Identity on the model's outputs whose backward differentiates only to the hooked layers.

    The outputs handed to the user are cut from the model graph (their only input is a
    fresh leaf, ``anchor``); their backward runs ``autograd.grad`` from the real outputs to
    the hooked layers' outputs (ghost differentiation), so ``loss.backward()`` computes no
    weight gradient and leaves ``.grad`` alone.
    """

    @staticmethod
    def forward(ctx, rec, differentiate, real_outputs, anchor, owned=None):
        ctx.rec, ctx.differentiate, ctx.real_outputs = rec, differentiate, real_outputs
        # Detached aliases of tensors that are not inputs of this Function: not views in
        # autograd's sense, so the user may edit them in place (e.g. mask logits); they share
        # the real outputs' version counters, so torch still refuses an in-place edit of an
        # output the model's graph saved, exactly as without hooks. Those whose rows are the
        # batch's samples are returned as SampleRows (tagged here: a view of this Function's
        # output would keep a failed step's graph alive).
        b = rec.step.batch_size
        tagged = lambda o: bool(b) and o.dim() > 0 and o.shape[0] == b and o.is_floating_point()  # noqa: E731
        handed = tuple(track(o.detach(), b, owned) if tagged(o) else o.detach() for o in real_outputs)
        ctx.tagged = [isinstance(o, SampleRows) for o in handed]  # watched: the loss must come through them
        return handed

    @staticmethod
    def backward(ctx, *grads):
        if ctx.real_outputs is None:  # the model's graph was freed by the first pass
            raise UnsupportedModuleError(
                "With ghost_backward=True the model's outputs can be back-propagated once per forward pass "
                "(the model's graph is freed then, even with retain_graph=True): add the losses and call "
                "backward once."
            )
        check_watched(ctx.tagged, grads)  # the loss was computed where dpzoo could follow it
        outs = [(o, g) for o, g in zip(ctx.real_outputs, grads) if g is not None]
        for o, g in outs:  # kept for the engine's first-step self-check (dpzoo.privacy.verify)
            ctx.rec.step.cotangents[id(o)] = g.detach()
        if outs:
            ctx.differentiate([o for o, _ in outs], [g for _, g in outs])
        ctx.real_outputs = None
        return None, None, None, None, None


def wrap_outputs(
    rec: Recorder,
    differentiate: Callable,
    output,
    found: list,
    owned: frozenset | None = None,
    model: torch.nn.Module | None = None,
):
    """``output`` with the tensors ``found`` in it replaced by their :class:`GhostBackward` aliases
    (same containers; dicts and ModelOutputs edited in place); those whose rows are the batch's
    samples watch the loss (:mod:`.sample_rows`; ``owned``: ids of the model's parameters), and so
    do the outputs without gradient (:func:`untracked_output`)."""
    anchor = torch.zeros((), requires_grad=True)
    wrapped = GhostBackward.apply(rec, differentiate, tuple(found), anchor, owned)
    mapping = {id(t): w for t, w in zip(found, wrapped)}
    b = rec.step.batch_size

    def rebuild(o):
        if isinstance(o, torch.Tensor):
            return mapping[id(o)] if id(o) in mapping else untracked_output(o, b, model)
        if isinstance(o, dict):  # dicts and transformers' ModelOutput
            for k in list(o.keys()):
                o[k] = rebuild(o[k])
            return o
        if isinstance(o, tuple):
            items = [rebuild(x) for x in o]
            return type(o)(*items) if hasattr(o, "_fields") else tuple(items)
        if isinstance(o, list):
            return [rebuild(x) for x in o]
        return o

    return rebuild(output)


def untracked_output(o: torch.Tensor, b: int | None, model: torch.nn.Module | None) -> torch.Tensor:
    """An output without gradient path, computed by the model from the batch: with the batch's rows
    (predictions, a detached copy of the logits), row i is sample i's; anything else is a statistic
    of the batch (``return out, out.detach().mean(0)``: refused where it meets the loss, as the same
    statistic computed after the model is). The model's own parameters and buffers returned as
    they are stay plain constants."""
    if isinstance(o, SampleRows) or not b:
        return o
    if o.dim() > 0 and o.shape[0] == b:
        return track(o, b)
    if model is not None and any(o is t for t in (*model.parameters(), *model.buffers())):
        return o
    return tag(o, State(b, sample_dim=None, stat=True))


def ghost_differentiate(rec: Recorder, plan: ModelPlan, roots: list, grads: list | None) -> None:
    """Back-propagate ``roots`` (with ``grads``, or as losses) to the recorded layer outputs and
    the bias-only layers, storing each use's output gradient; then audit the step's uses."""
    # Count the uses in the graph of these roots too: with ghost_backward, hooks.backward
    # counted only the loss's graph, and several forward passes each reach here once.
    count_edges(rec.step, roots)
    if rec.step.reentrant_checkpoint:
        # autograd.grad runs a reentrant checkpoint's node only when a target lies behind it (then torch
        # refuses); with none (an input that requires grad, no hooked layer before it) it skips the
        # node and every layer inside silently (norms 37-83% low, found by a review, 2026-11-28)
        raise UnsupportedModuleError(
            "Reentrant activation checkpointing (torch.utils.checkpoint(..., use_reentrant=True)) hides the layers "
            "it wraps from dpzoo's ghost differentiation. Pass use_reentrant=False (Hugging Face: "
            "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}))."
        )
    uses = [u for u in rec.step.uses if u.edge is not None and u.output is not None and u.output.requires_grad]
    targets = [u.edge for u in uses]
    n_edges = len(targets)
    for mp in plan.modules:  # bias-only layers: their output-gradient hooks fire on the way
        if not mp.needs_activations:
            for n in mp.params:
                p = getattr(mp.module, n)
                if is_dtensor(p):  # FSDP2: the graph holds the unsharded stand-ins seen in forward
                    targets += [a for a in aliases_of(rec.step.aliases, p) if a.requires_grad]
                elif p.requires_grad:
                    targets.append(p)
    if not targets:
        raise PrivacyUsageError(
            "No hooked layer took part in this forward pass; nothing to differentiate: run the hooked model's "
            "forward before the backward (under torch.compile: a graph compiled without dpzoo's hooks ran; call "
            "torch._dynamo.reset() after make_private)."
        )
    outer = torch._C._current_graph_task_id()  # the user's loss.backward() (ghost_backward), or none
    rec.n_passes += 1
    rec.pass_id = outer if outer != -1 else ("hooks.backward", rec.n_passes)
    rec.by_edges = True
    try:
        with warnings.catch_warnings():
            # torch warns when a hooked layer's inputs need no gradient (the first layer's
            # never do): expected here, since only output gradients are wanted
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            got = torch.autograd.grad(roots, targets, grads, allow_unused=True)
    finally:
        rec.by_edges = False
    for use, g in zip(uses, got[:n_edges]):
        if g is not None:
            g = as_output(g.detach(), use.view_of)
            use.grad = g if use.grad is None else use.grad + g
    rec.step.backward_done = True
    compare_uses(rec.step, plan.params)
