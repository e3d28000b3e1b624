"""dpzoo's own version (``__version__``), the torch and transformers versions dpzoo's exactness suites were run on, and the warning when
the installed ones are outside them.

dpzoo reads autograd internals (gradient edges, graph task ids, how views and in-place ops are
recorded) and mirrors transformers' layers, so "which versions is this exact on" has a tested
answer: ``TESTED`` below, produced by ``tools/compatibility.py`` (its table:
``docs/COMPATIBILITY.md``). Outside that range dpzoo still runs, and still refuses what it cannot
check, but it warns once (:class:`~dpzoo.errors.UntestedVersionWarning`) on import: the engine's
first-step self-check (on by default) is then what catches a version whose behaviour changed.

Reads installed metadata only; importing this module does not import torch.
"""

from __future__ import annotations

import re
import warnings
from functools import cache
from importlib import metadata

from .errors import UntestedVersionWarning

__all__ = ["__version__", "TESTED", "installed", "untested", "warn_if_untested"]

__version__ = "0.1.0"  # pyproject.toml's; tests/test_versions.py checks they agree

# package -> (lowest, newest) version the exactness suites passed on (docs/COMPATIBILITY.md)
TESTED: dict[str, tuple[str, str]] = {
    "torch": ("2.11.0", "2.14.1"),
    "transformers": ("5.4.0", "5.24.0"),
}


def release(version: str) -> tuple[int, ...]:
    """``"2.11.0+cu130"`` -> ``(2, 11, 0)``: the numeric release, local and pre-release tags dropped."""
    m = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(x) for x in m.group(0).split(".")) if m else ()


def installed(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def untested(versions: dict[str, str | None] | None = None) -> list[str]:
    """One line per package whose installed version is outside ``TESTED`` (none installed: skipped)."""
    found = {p: installed(p) for p in TESTED} if versions is None else versions
    out = []
    for package, (low, high) in TESTED.items():
        v = found.get(package)
        if v is not None and not release(low) <= release(v) <= release(high):
            out.append(f"{package} {v} (tested: {low} to {high})")
    return out


@cache
def warn_if_untested() -> None:
    """Warn once per process (the call is cached) if torch or transformers is outside the tested range."""
    outside = untested()
    if outside:
        warnings.warn(
            f"dpzoo's exactness suites have not been run on {'; '.join(outside)}. dpzoo relies on their "
            "internals: keep the engine's first-step self-check on (the default), or install the tested set "
            "with pip install -e '.[test]' -c constraints.txt.",
            UntestedVersionWarning,
            stacklevel=3,
        )
