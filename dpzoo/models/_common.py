"""Shared pieces of the zoo builders: the override table (each override declared once, with its
meaning and its conversion), override parsing (unknown names, synonyms) and the patch options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from ..errors import OverrideError
from ..registry import OVERRIDE_SYNONYMS, reject_unknown_overrides

# Options of dpzoo's surgery, accepted by every built-in entry (recorded on save).
PATCH_OPTIONS = {
    "gn_groups": "GroupNorm groups: 'auto' (largest divisor of C ≤ 32 with ≥ 2 channels per group) or an int",
    "bias_init": "'zero' (default; outputs unchanged) or 'normal' for the biases BiTFiT-Add adds",
    "bias_std": "standard deviation for bias_init='normal' (default 1e-3)",
    "bias_seed": "seed for bias_init='normal'",
}


def split_patch_options(overrides: dict[str, Any], defaults: dict[str, Any] | None = None) -> tuple[dict, dict]:
    """``overrides`` → (architecture overrides, keyword arguments of make_dp_ready)."""
    arch = dict(overrides)
    patch = dict(defaults or {})
    for key in PATCH_OPTIONS:
        if key in arch:
            patch[key] = arch.pop(key)
    return arch, patch


@dataclass(frozen=True)
class Override:
    """One keyword argument of a zoo entry, declared once: ``doc`` is what the model card says,
    ``to_kwargs`` checks a value and turns it into the library's keyword arguments."""

    doc: str
    to_kwargs: Callable[[Any], dict[str, Any]]


OverrideTable = Mapping[str, Override]

SYNONYMS = OVERRIDE_SYNONYMS  # synonym → the name in a timm entry's table


def card_overrides(table: OverrideTable) -> dict[str, str]:
    """The card's override documentation: the table's, its synonyms, then the patch options."""
    docs: dict[str, str] = {}
    for key, o in table.items():
        docs[key] = o.doc
        docs.update(
            {s: f"Hugging Face's name for `{key}` (give one of the two)" for s, c in SYNONYMS.items() if c == key}
        )
    return {**docs, **PATCH_OPTIONS}


def resolve_synonyms(entry: str, overrides: Mapping[str, Any], table: OverrideTable) -> dict[str, Any]:
    """``overrides`` with each synonym (``num_labels``) renamed to the table's name (``num_classes``);
    both given with different values is an :class:`OverrideError`."""
    out = dict(overrides)
    for synonym, canonical in SYNONYMS.items():
        if synonym not in out or canonical not in table:
            continue
        value = out.pop(synonym)
        if canonical in out and out[canonical] != value:
            raise OverrideError(
                f"{entry}: {canonical}={out[canonical]!r} and {synonym}={value!r} name the same setting "
                f"with different values; pass only one of them."
            )
        out[canonical] = value
    return out


def library_kwargs(entry: str, table: OverrideTable, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Architecture ``overrides`` (patch options removed) → the library's keyword arguments."""
    reject_unknown(entry, overrides, list(table) + [s for s, c in SYNONYMS.items() if c in table])
    kwargs: dict[str, Any] = {}
    for key, value in resolve_synonyms(entry, overrides, table).items():
        kwargs.update(table[key].to_kwargs(value))
    return kwargs


def reject_unknown(entry: str, given: Iterable[str], accepted: Iterable[str]) -> None:
    """:func:`dpzoo.registry.reject_unknown_overrides` with the patch options every entry takes."""
    reject_unknown_overrides(entry, given, set(accepted) | set(PATCH_OPTIONS))


def from_scratch(card, build: Callable, pretrained: bool, pretrained_tag: str | None, weights, overrides: dict):
    """A zoo entry written DP-ready and trained from scratch: no pretrained weights, no ``weights=``,
    only the card's overrides (a misspelt one gets "did you mean")."""
    from ..surgery import make_dp_ready

    if pretrained or pretrained_tag is not None:
        raise OverrideError(f"{card.name} has no pretrained weights: train it from scratch (dpzoo train {card.name}).")
    if weights is not None:
        raise OverrideError(f"{card.name} takes no weights=: restore a saved one with dpzoo.load(DIR).")
    reject_unknown_overrides(card.name, overrides, card.overrides)
    return make_dp_ready(build(**overrides))  # nothing to patch; records the (empty) patch report
