"""Freed memory kept for reuse on a CPU: one call that tells glibc's malloc to serve every
allocation from its heap and keep what is freed, instead of mapping each large tensor from the
OS and unmapping it when freed.

A DP step allocates and frees more large tensors than a non-private one (per-sample gradients,
Gram matrices, the noise), each above glibc's mmap threshold: every step then pays the kernel to
map and zero fresh pages. Measured on 2 CPU cores (benchmarks/results/floor and floor_reuse):
GPT-2 4×256's bk-mixopt step went from 1.38× to 1.19× of the non-private step when the process
kept its freed memory; PyTorch's CPU tuning guide gives the same advice with jemalloc or TCMalloc. The cost
is memory: the process keeps its peak heap (what a training loop reuses every step anyway).

Opt-in and process-wide, so dpzoo never calls it on import; benchmarks take
``--reuse-freed-memory``.
"""

from __future__ import annotations

import ctypes
import platform
import sys

__all__ = ["reuse_freed_memory"]

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1


def reuse_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse: no allocation served by mmap
    (``M_MMAP_MAX`` = 0) and the heap's top not returned to the OS below 2 GiB
    (``M_TRIM_THRESHOLD``). Returns True where it applied (Linux with glibc), False elsewhere,
    where it does nothing. The same as starting Python with ``MALLOC_MMAP_MAX_=0
    MALLOC_TRIM_THRESHOLD_=2147483647``; from the next allocation on."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:  # pragma: no cover - glibc always has it
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _INT_MAX))
