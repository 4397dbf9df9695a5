"""foundation.host_allocator: with glibc's mmap threshold pinned, a tensor smaller than one freed
before it still gets a mapping of its own (returned to the system when freed) instead of arena
pages the process keeps. Observed through glibc's own count of mapped bytes (``mallinfo2``), in
a fresh process: the setting is process-wide and the adaptive threshold depends on history."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from foundation.host_allocator import pin_mmap_threshold

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")

ROOT = Path(__file__).resolve().parents[1]
PROBE = textwrap.dedent("""
    import ctypes, sys, torch
    from foundation.host_allocator import pin_mmap_threshold
    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks "
                    "keepcost".split()]
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Info
    if sys.argv[1] == "pin":
        assert pin_mmap_threshold()
    big = torch.ones(4 << 20)            # 16 MiB, mapped; freeing it raises the adaptive threshold
    del big
    before = libc.mallinfo2().hblkhd
    small = torch.ones(2 << 20)          # 8 MiB
    print(libc.mallinfo2().hblkhd - before >= small.nbytes)
""")


def _mapped_on_its_own(mode: str) -> bool:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         check=True, cwd=ROOT, env=env)
    return out.stdout.strip() == "True"


def test_pinned_threshold_maps_a_tensor_smaller_than_one_freed_before() -> None:
    assert not _mapped_on_its_own("adaptive")  # glibc's default: arena pages, kept when freed
    assert _mapped_on_its_own("pin")


def test_a_user_setting_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert pin_mmap_threshold() is False


def test_a_threshold_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="nbytes=0.*positive"):
        pin_mmap_threshold(0)
