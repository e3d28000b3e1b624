"""Per-sample position ids for Hugging Face models with learned position embeddings.

GPT-2 and BERT look up ``wpe(position_ids)`` / ``position_embeddings(position_ids)`` with
``position_ids`` of batch size 1 and broadcast the result over the batch. The embedding's
gradient is then the sum over all samples, and per-sample-gradient code sees one "sample":
Opacus' hooks fail ("stack expects each tensor to be equal size") or, in ghost mode,
broadcast one norm to every sample. dpzoo's models pass ``position_ids`` of shape (B, T),
the same positions HF would use (0..T-1 without a cache), so every engine sees per-sample
lookups. With a KV cache (generation), HF's own positions are kept.
"""

from __future__ import annotations

import torch

_CLASSES: dict[type, type] = {}


class PerSamplePositionIdsMixin:
    def forward(self, input_ids=None, *args, **kwargs):
        if (not args and input_ids is not None and kwargs.get("position_ids") is None
                and kwargs.get("past_key_values") is None and input_ids.dim() == 2):
            b, t = input_ids.shape
            # contiguous: some engines .view() the lookup ids
            kwargs["position_ids"] = torch.arange(t, device=input_ids.device).unsqueeze(0).expand(b, t).contiguous()
        return super().forward(input_ids, *args, **kwargs)


def with_per_sample_position_ids(model):
    """Swap ``model``'s class for a subclass that fills per-sample position ids (in place)."""
    cls = type(model)
    if issubclass(cls, PerSamplePositionIdsMixin):
        return model
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (PerSamplePositionIdsMixin, cls),
                             {"__module__": __name__, "__qualname__": cls.__qualname__,
                              "__doc__": cls.__doc__})
    model.__class__ = _CLASSES[cls]
    return model
