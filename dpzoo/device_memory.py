"""How much memory training may use on a device: one job, shared by the hook planner's memory budget
(:func:`dpzoo.grad_norms.cost.default_budget`) and the automatic physical batch of next-item training
(:mod:`dpzoo.seqrec.memory`).

On CUDA the driver's free memory (``torch.cuda.mem_get_info``); elsewhere the system's (MPS shares
it): ``MemAvailable`` of /proc/meminfo (not MemFree, which leaves out the page cache the kernel
gives back on demand), lowered to the room left under a cgroup memory limit when one is set (a
container), else psutil's ``available``, else a fixed :data:`ASSUMED_AVAILABLE` of 4 GB; the
source is returned beside the figure so callers can say where it came from.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["available_memory", "ASSUMED_AVAILABLE"]

# bytes assumed available where neither /proc/meminfo nor psutil can tell
ASSUMED_AVAILABLE = 4e9
# where the system's memory is read (tests point them elsewhere)
MEMINFO = Path("/proc/meminfo")
CGROUP_FILES = (  # (limit, usage): cgroup v2, then v1
    (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")),
    (Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"), Path("/sys/fs/cgroup/memory/memory.usage_in_bytes")),
)


def _meminfo_available() -> float | None:
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room() -> float | None:
    """Bytes left under this process's cgroup memory limit, None without a limit."""
    for limit_file, usage_file in CGROUP_FILES:
        try:
            limit_text, usage_text = limit_file.read_text().strip(), usage_file.read_text().strip()
        except OSError:
            continue
        if limit_text == "max":
            return None
        try:
            limit, usage = float(limit_text), float(usage_text)
        except ValueError:
            continue
        return max(0.0, limit - usage) if limit < 2**60 else None  # v1 writes "no limit" as ~2^63
    return None


def available_memory(device: torch.device | str) -> tuple[float, str]:
    """(bytes available to training on ``device``, where the figure comes from: "cuda",
    "MemAvailable", "MemAvailable, cgroup limit", "psutil" or "assumed"); see the module docstring."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return float(torch.cuda.mem_get_info(dev)[0]), "cuda"
    available = _meminfo_available()
    if available is not None:
        room = _cgroup_room()
        if room is not None and room < available:
            return room, "MemAvailable, cgroup limit"
        return available, "MemAvailable"
    try:
        import psutil
    except ImportError:
        return ASSUMED_AVAILABLE, "assumed"
    return float(psutil.virtual_memory().available), "psutil"
