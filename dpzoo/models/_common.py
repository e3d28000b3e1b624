"""Shared pieces of the zoo builders: the override table (each override declared once, with its
meaning and its conversion), override parsing and the patch options."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from ..errors import OverrideError

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


def card_overrides(table: OverrideTable) -> dict[str, str]:
    """The card's override documentation: the table's, then the patch options every entry takes."""
    return {**{k: o.doc for k, o in table.items()}, **PATCH_OPTIONS}


def library_kwargs(entry: str, table: OverrideTable, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Architecture ``overrides`` (patch options removed) → the library's keyword arguments."""
    reject_unknown(entry, overrides, table)
    kwargs: dict[str, Any] = {}
    for key, value in overrides.items():
        kwargs.update(table[key].to_kwargs(value))
    return kwargs


def reject_unknown(entry: str, given: Iterable[str], accepted: Iterable[str]) -> None:
    accepted = sorted(set(accepted) | set(PATCH_OPTIONS))
    bad = [k for k in given if k not in accepted]
    if bad:
        close = {k: difflib.get_close_matches(k, accepted, n=1, cutoff=0.6) for k in bad}
        hint = "; ".join(f"did you mean {c[0]!r} for {k!r}?" for k, c in close.items() if c)
        raise OverrideError(
            f"{entry} does not accept override(s) {', '.join(map(repr, bad))}"
            + (f" ({hint})" if hint else "")
            + f". Accepted: {', '.join(accepted)}. (`dpzoo.model_card({entry!r})` documents them.)"
        )
