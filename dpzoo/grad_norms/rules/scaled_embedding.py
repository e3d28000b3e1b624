"""transformers' scaled word embeddings (Gemma's ``GemmaTextScaledWordEmbedding`` and its
relatives): an nn.Embedding whose forward multiplies the looked-up rows by a constant
``embed_scale`` (√width). They override ``nn.Embedding.forward``, so the Embedding rule does not
apply to them (the registry's override check); this rule is the Embedding rule (one-hot,
:class:`~dpzoo.grad_norms.reps.OneHot`) with the output gradient times that constant, the chain
rule of ``lookup(ids) · scale``. The check refuses a class whose forward is not that product.
"""

from __future__ import annotations

import importlib
import inspect

from torch import nn

from ..registry import register_rule
from .embedding import embedding_check, lookup_rep

# (module, class) of the scaled embeddings whose forward is `super().forward(ids) * self.embed_scale`
_CLASSES = (
    ("transformers.models.gemma.modeling_gemma", "GemmaTextScaledWordEmbedding"),
    ("transformers.models.gemma3.modeling_gemma3", "Gemma3TextScaledWordEmbedding"),
)
_EMBEDDING_FORWARD = inspect.getattr_static(nn.Embedding, "forward")
# the whole body of the forward the rule was written for, whitespace removed
_FORWARD_BODY = "returnsuper().forward(input_ids)*self.embed_scale.to(self.weight.dtype)"


def scaled_embedding_check(module) -> str | None:
    """Why a scaled embedding cannot get the rule (an Embedding's reasons, a replaced
    nn.Embedding.forward, or a forward that is not lookup × embed_scale), or None."""
    if inspect.getattr_static(nn.Embedding, "forward") is not _EMBEDDING_FORWARD:
        return "nn.Embedding.forward, which its forward calls, was replaced after dpzoo's rules were registered"
    try:
        source = "".join(inspect.getsource(type(module).forward).split())
    except (OSError, TypeError):
        return f"the source of {type(module).__name__}.forward is unavailable, so its arithmetic cannot be checked"
    if not source.endswith(_FORWARD_BODY):
        return f"{type(module).__name__}.forward is not the lookup times embed_scale this rule was written for"
    return embedding_check(module)


def scaled_embedding_rule(module, activations, grad_output, params):
    scale = module.embed_scale.to(grad_output.dtype)
    rep = lookup_rep(activations[0], grad_output * scale, module.num_embeddings, module.padding_idx)
    return {"weight": rep}


def _register() -> None:
    for module_name, class_name in _CLASSES:
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):  # pragma: no cover - another transformers version
            continue
        register_rule(cls, params=("weight",), check=scaled_embedding_check)(scaled_embedding_rule)


_register()
