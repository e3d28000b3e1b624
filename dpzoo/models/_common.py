"""Shared pieces of the zoo builders: override parsing and the patch options."""

from __future__ import annotations

from typing import Any, Iterable

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


def reject_unknown(entry: str, given: Iterable[str], accepted: Iterable[str]) -> None:
    accepted = sorted(set(accepted) | set(PATCH_OPTIONS))
    bad = [k for k in given if k not in accepted]
    if bad:
        raise OverrideError(
            f"{entry} does not accept override(s) {', '.join(map(repr, bad))}. "
            f"Accepted: {', '.join(accepted)}. (`dpzoo.model_card({entry!r})` documents them.)"
        )
