"""What the engine does around each training call of the model: the batch's rows go in as plain
tensors, and a Hugging Face model called with ``labels=`` gets its loss computed per sample.

The engine's data loader hands out the batch as :class:`~dpzoo.grad_norms.sample_rows.SampleRows`
(row i is sample i), so that mixing rows before the model (mixup, a shifted copy of the batch) is
seen; the model itself gets ordinary tensors, and rows reordered or combined are refused here.


A transformers head computes its loss inside ``forward``: a causal or masked LM averages over all
the batch's labelled tokens, so one sample's weight depends on the others' lengths, and the loss
comes back as a scalar the engine cannot split by sample. The engine takes
the labels away before the model sees them (a forward pre-hook that runs first) and, after the
model, sets ``output.loss`` to the mean (``loss_reduction="mean"``) or sum of the per-sample
losses of :func:`dpzoo.integrations.trainer_loss.per_sample_losses`: each sample's own token mean
for language models (a causal LM's labels shifted by one), the head's rule for sequence
classification. Encoder-decoder models get their decoder inputs from the labels as they would
themselves (``prepare_decoder_input_ids_from_labels``). Under ``torch.no_grad()`` (evaluation)
the model computes its own loss, as without dpzoo.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import LossMixingError, PrivacyUsageError
from ..grad_norms.copy_inert import CopyInert
from ..grad_norms.sample_rows import SampleRows, State, note_call, plain, tag

__all__ = ["attach_call_hooks", "is_transformers_model"]


def is_transformers_model(module: nn.Module) -> bool:
    base = module.get_base_model() if callable(getattr(module, "get_base_model", None)) else module
    return any(c.__module__.startswith("transformers.") and c.__name__ == "PreTrainedModel" for c in type(base).__mro__)


@torch.compiler.disable  # runs eagerly under torch.compile: dynamo does not trace SampleRows
def plain_inputs(module, args, kwargs):
    """The root's first forward pre-hook: the batch's tracked rows as plain tensors; an input that
    requires grad is refused (no gradient reaches the inputs through ghost differentiation)."""
    leaves = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
    if torch.is_grad_enabled() and any(a.requires_grad for a in leaves):
        raise PrivacyUsageError(
            "An input of the private model requires grad: dpzoo's engine back-propagates only to the model's own "
            "layers (ghost differentiation), so no gradient reaches its inputs (gradient penalty, FGSM, a trainable "
            "module before the model). Take input gradients on copy.deepcopy(model), a plain copy without dpzoo's "
            "hooks; put trainable modules inside the model."
        )
    if torch.is_grad_enabled() and isinstance(kwargs.get("num_items_in_batch"), torch.Tensor):  # evaluation may
        raise LossMixingError(
            "num_items_in_batch (the batch's label count, a tensor) divides each sample's loss by a count over all "
            "samples, which mixes samples (false ε): drop it; with labels= dpzoo computes each sequence's own loss."
        )
    note_call(leaves, module)
    tracked = any(isinstance(a, SampleRows) for a in leaves)
    return tree_map(plain, (tuple(args), dict(kwargs))) if tracked else None


class LabelsLoss:
    """The two hooks; ``labels`` holds those of the forward pass in flight."""

    def __init__(self, module: nn.Module, loss_reduction: str):
        from ..integrations.trainer_loss import loss_kind

        self.loss_reduction, self.kind = loss_reduction, loss_kind(module)
        self.labels: torch.Tensor | None = None

    def before(self, module, args, kwargs):
        self.labels = None
        if not torch.is_grad_enabled() or kwargs.get("labels") is None:
            return None
        kwargs = dict(kwargs)
        labels = kwargs.pop("labels")
        config = getattr(module, "config", None)
        if getattr(config, "is_encoder_decoder", False) and kwargs.get("decoder_input_ids") is None:
            prepare = getattr(module, "prepare_decoder_input_ids_from_labels", None)
            if prepare is None:
                raise PrivacyUsageError(
                    f"{type(module).__name__} makes its decoder inputs from labels=, which dpzoo takes to compute "
                    "per-sample losses: pass decoder_input_ids= as well."
                )
            kwargs["decoder_input_ids"] = prepare(labels=labels)
        self.labels = labels
        return args, kwargs

    def after(self, module, args, kwargs, output):
        labels, self.labels = self.labels, None
        if labels is None:
            return None
        from ..integrations.trainer_loss import per_sample_losses

        config = getattr(module, "config", None)
        lead = next((o for o in tree_flatten(output)[0] if isinstance(o, SampleRows)), None)
        if lead is not None and labels.dim() and labels.shape[0] == lead.shape[0]:  # the labels' rows are the outputs'
            labels = tag(labels, State(lead.rows.samples, window=lead.rows.window))
        losses = per_sample_losses(
            output,
            labels,
            kind=self.kind,
            problem_type=getattr(config, "problem_type", None),
            num_labels=getattr(config, "num_labels", None),
        )
        loss = losses.mean() if self.loss_reduction == "mean" else losses.sum()
        if isinstance(output, dict):  # ModelOutput: the loss field the model left None
            output["loss"] = loss
            return output
        return (loss, *output) if isinstance(output, tuple) else output


def attach_call_hooks(module: nn.Module, loss_reduction: str) -> list:
    """Register the hooks on the model; their handles. The pre-hooks run before every other (the
    labels are taken after the rows are made plain); the loss hook after the norm hooks wrapped
    the outputs."""
    handles = []
    if is_transformers_model(module):
        hooks = LabelsLoss(module, loss_reduction)
        handles += [
            module.register_forward_pre_hook(CopyInert(hooks.before), with_kwargs=True, prepend=True),
            module.register_forward_hook(CopyInert(hooks.after), with_kwargs=True),
        ]
    handles.append(module.register_forward_pre_hook(CopyInert(plain_inputs), with_kwargs=True, prepend=True))
    return handles
