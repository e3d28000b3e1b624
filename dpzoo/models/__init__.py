"""The zoo: dpzoo's own entries, registered when this package is imported, and the lookups over
every registered entry (:func:`list_models`, :func:`model_card`, :func:`get_entry`,
:func:`is_model`, :func:`split_name`, :func:`unregister_model`), as timm keeps ``list_models``
beside its models. :mod:`dpzoo.registry` holds the entries and ``register_model`` and imports no
model: the models register into it. The sequential-recommendation entries live with their models
in :mod:`dpzoo.seqrec.zoo`.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Callable, Iterable

from ..errors import InvalidArgumentError, UnknownModelError
from ..registry import ENTRIES, ModelCard, ModelEntry
from ..seqrec import zoo as _seqrec_zoo
from . import bert, cnn, convnext, efficientnet, gemma, gpt2, llama, mistral, mlp, nfnet, qwen2, resnet, t5, vit, wrn  # noqa: F401

_seqrec_zoo.register()  # transformer-seqrec, transformer-seqrec-untied, dpformer, gru-seqrec, lstm-seqrec

__all__ = ["list_models", "model_card", "get_entry", "is_model", "split_name", "unregister_model"]


def unregister_model(name: str) -> Callable[..., Any]:
    """Remove an entry registered with :func:`register_model` and return its builder (a plugin's
    tests clean up with it). dpzoo's own entries cannot be removed."""
    if name not in ENTRIES:
        raise UnknownModelError(name, ENTRIES)
    builder = ENTRIES[name].builder
    if builder.__module__.split(".")[0] == "dpzoo":
        raise InvalidArgumentError(f"{name!r} is one of dpzoo's own zoo entries and cannot be unregistered.")
    del ENTRIES[name]
    return builder


def list_models(pattern: str | Iterable[str] = "*", *, pretrained: bool = False) -> list[str]:
    """Names of zoo entries matching ``pattern`` (fnmatch, or a list of patterns).

    With ``pretrained=True``, only entries that have at least one pretrained tag.
    """
    patterns = [pattern] if isinstance(pattern, str) else list(pattern)
    names = [n for n in ENTRIES if any(fnmatch.fnmatch(n, p) for p in patterns)]
    if pretrained:
        names = [n for n in names if ENTRIES[n].card.pretrained_tags]
    return sorted(names)


def split_name(name: str) -> tuple[str, str | None]:
    """Split a zoo name into its entry and its pretrained tag.

    ``"resnet18-gn-bias.a1_in1k"`` → ``("resnet18-gn-bias", "a1_in1k")``. The tag is everything
    after the entry's name and one dot, so a Hugging Face hub id with slashes and dots is a tag too:
    ``"gpt2.openai-community/gpt2"`` → ``("gpt2", "openai-community/gpt2")``,
    ``"bert-base.org/model-v1.5"`` → ``("bert-base", "org/model-v1.5")``. A registered entry whose
    own name has a dot is matched whole (the longest registered name wins); an unknown name is
    split at its first dot.
    """
    if name in ENTRIES:
        return name, None
    base = max((n for n in ENTRIES if name.startswith(n + ".")), key=len, default=None)
    if base is None:
        base = name.partition(".")[0]
    tag = name[len(base) + 1 :]
    return base, (tag or None)


def get_entry(name: str) -> ModelEntry:
    base, _ = split_name(name)
    if base not in ENTRIES:
        raise UnknownModelError(name, ENTRIES)
    return ENTRIES[base]


def is_model(name: str) -> bool:
    return split_name(name)[0] in ENTRIES


def model_card(name: str) -> ModelCard:
    """The :class:`ModelCard` of a zoo entry (``str(card.to_markdown())`` to read it)."""
    return get_entry(name).card
