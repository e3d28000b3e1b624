"""Per-sample position ids for Hugging Face models with learned position embeddings.

GPT-2 and BERT look up ``wpe(position_ids)`` / ``position_embeddings(position_ids)`` with
``position_ids`` of batch size 1 and broadcast the result over the batch. The embedding's
gradient is then the sum over all samples, and per-sample-gradient code sees one "sample":
Opacus' hooks fail ("stack expects each tensor to be equal size") or, in ghost mode,
broadcast one norm to every sample. dpzoo's models pass ``position_ids`` of shape (B, T),
the same positions HF would use (0..T-1 without a cache), so every engine sees per-sample
lookups. With a KV cache (generation), HF's own positions are kept.

The ids are filled by a forward pre-hook, a module-level function: the model keeps its own
class (no class is created at run time), so ``torch.save(model)`` / ``pickle`` round-trip it.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["per_sample_position_ids", "with_per_sample_position_ids", "has_per_sample_position_ids"]


def per_sample_position_ids(module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook (``with_kwargs=True``): pass ``position_ids`` of shape (B, T) when the
    caller gave none, no KV cache is in use and ``input_ids`` is the only positional argument."""
    input_ids = args[0] if args else kwargs.get("input_ids")
    if (
        len(args) > 1
        or not isinstance(input_ids, torch.Tensor)
        or input_ids.dim() != 2
        or kwargs.get("position_ids") is not None
        or kwargs.get("past_key_values") is not None
    ):
        return None
    b, t = input_ids.shape
    # contiguous: some engines .view() the lookup ids; a new dict: callers' kwargs stay untouched
    positions = torch.arange(t, device=input_ids.device).unsqueeze(0).expand(b, t).contiguous()
    return args, {**kwargs, "position_ids": positions}


def has_per_sample_position_ids(model: nn.Module) -> bool:
    return any(h is per_sample_position_ids for h in model._forward_pre_hooks.values())


def with_per_sample_position_ids(model: nn.Module) -> nn.Module:
    """Make ``model`` (a Hugging Face model taking ``position_ids``) look up positions per sample,
    in place: registers :func:`per_sample_position_ids` once as a forward pre-hook."""
    if not has_per_sample_position_ids(model):
        model.register_forward_pre_hook(per_sample_position_ids, with_kwargs=True)
    return model
