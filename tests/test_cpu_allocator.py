"""dpzoo.cpu_allocator: glibc keeps freed memory for reuse. Each check runs in a fresh process:
the setting is process-wide and would otherwise change the memory of every later test."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"

# bytes glibc newly holds in mmap'd blocks (mallinfo2().hblkhd) while holding a 64 MiB tensor and after a step
PROBE = textwrap.dedent(
    """
    import ctypes, sys, torch
    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = Info
    if sys.argv[1] == "reuse":
        from dpzoo.cpu_allocator import reuse_freed_memory
        assert reuse_freed_memory() is True
    before = libc.mallinfo2().hblkhd
    x = torch.ones(16 * 2**20)  # 64 MiB
    model = torch.nn.Linear(64, 8)
    model(torch.randn(32, 64)).square().sum().backward()  # training still runs
    assert model.weight.grad is not None and float(x.sum()) == 16 * 2**20
    print(libc.mallinfo2().hblkhd - before)
    """
)


def _mmapped(arg: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, arg], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_large_tensors_come_from_the_heap_once_freed_memory_is_kept():
    assert _mmapped("default") >= 64 * 2**20  # glibc maps a 64 MiB block from the OS by default
    assert _mmapped("reuse") <= 0  # served from the heap, which keeps what is freed


def test_elsewhere_it_does_nothing(monkeypatch):
    from dpzoo import cpu_allocator

    monkeypatch.setattr(cpu_allocator.sys, "platform", "darwin")
    assert cpu_allocator.reuse_freed_memory() is False


def test_the_dpzoo_command_keeps_freed_memory_and_main_leaves_it_alone(monkeypatch):
    """The console script (its own process) applies the setting before running the command;
    ``main``, which tests and scripts call in their own process, does not."""
    from dpzoo import cpu_allocator
    from dpzoo.cli import commands

    calls = []
    monkeypatch.setattr(cpu_allocator, "reuse_freed_memory", lambda: calls.append("reuse") or True)
    monkeypatch.setattr(commands, "main", lambda argv=None: calls.append("main") or 0)
    assert commands.run() == 0 and calls == ["reuse", "main"]
    calls.clear()
    monkeypatch.undo()
    monkeypatch.setattr(cpu_allocator, "reuse_freed_memory", lambda: calls.append("reuse") or True)
    assert commands.main(["list"]) == 0 and calls == []
