"""The quarantine allocator of ``.ci/quarantine.py`` (issue 44) finds the heap misuse it is for:
a write into a freed block, a write past a block's end and a second free, each reported with the
stack that freed the block, in the process's log; and a torch training loop that churns far more
than the quarantine holds runs clean through it (the allocator's own eviction once overran a
stack buffer when the quarantine was small)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "quarantine", Path(__file__).resolve().parent.parent / ".ci" / "quarantine.py")
assert _SPEC is not None and _SPEC.loader is not None
quarantine = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(quarantine)

pytestmark = pytest.mark.slow  # each case starts a process on the built library

MISUSE = {
    "write after free": "p = libc.malloc(64); libc.free(p); ctypes.memset(p + 8, 1, 4)",
    "write past the end": "p = libc.malloc(64); ctypes.memset(p + 64, 7, 2); libc.free(p)",
    "free of a block already freed": "p = libc.malloc(64); libc.free(p); libc.free(p)",
}


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return quarantine.build(tmp_path_factory.mktemp("quarantine"))
    except RuntimeError as error:
        pytest.skip(str(error))


def _run(library: Path, log: Path, code: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a process on the library with its defaults (and ``env``): settings of a
    suite itself run under ``make quarantine`` are not this case's."""
    base = {k: v for k, v in quarantine.environment(library, log).items()
            if not k.startswith("QUARANTINE_") or k == "QUARANTINE_LOG"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300, env={**base, **env})


@pytest.mark.parametrize("kind", list(MISUSE))
def test_each_kind_of_heap_misuse_is_reported_with_the_stack_that_freed_it(library, tmp_path,
                                                                           kind):
    log = tmp_path / "reports.log"
    done = _run(library, log, f"""
        import ctypes
        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        {MISUSE[kind]}
        """)
    assert done.returncode == 0, done.stderr
    found = quarantine.reports(log.read_text())
    assert len(found) == 1 and kind in found[0], found
    assert "ffi_call" in found[0] or "_ctypes" in found[0]  # the stack of the free (or the call)
    if kind != "free of a block already freed":
        assert "block of 64 bytes" in found[0]


def test_a_training_loop_churning_past_a_tiny_quarantine_runs_clean(library, tmp_path):
    log = tmp_path / "reports.log"
    done = _run(library, log, """
        import torch
        layers = [torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)]
        model = torch.nn.Sequential(*layers)
        opt = torch.optim.SGD(model.parameters(), 0.01)
        for _ in range(300):
            model(torch.randn(32, 64)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        print("trained")
        """, QUARANTINE_MB="1", QUARANTINE_VERBOSE="1")
    assert done.returncode == 0 and "trained" in done.stdout, done.stderr
    text = log.read_text()
    assert quarantine.reports(text) == []
    checked = [int(n) for n in re.findall(r"(\d+) freed blocks checked", text)]
    assert max(checked) > 10_000, text  # blocks really went through the quarantine and back


def test_the_log_reader_splits_reports_and_ignores_the_summary():
    log = ("[quarantine pid 7] 10 freed blocks checked, 0 violations\n"
           "\n[quarantine pid 8] write after free: block of 64 bytes at 0x1, 4 bytes changed\n"
           "  freed at:\nlib.so(free+0x1)\n"
           "[quarantine pid 8] signal 11 at address 0xa5a5; native stack:\nlib.so(x+0x2)\n")
    first, second = quarantine.reports(log)
    assert first.startswith("[quarantine pid 8] write after free") and "freed at" in first
    assert second.startswith("[quarantine pid 8] signal 11") and "freed at" not in second
