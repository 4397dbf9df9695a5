""".ci/memcheck.py's reading of a valgrind log (issue 44): a use after free fails the run, the
dynamic loader's word-sized reads past rpath strings and uninitialised reads do not."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "memcheck", Path(__file__).resolve().parent.parent / ".ci" / "memcheck.py")
assert _SPEC is not None and _SPEC.loader is not None
memcheck = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(memcheck)

LOG = """==41== Memcheck, a memory error detector
==41==
==41== Invalid read of size 8
==41==    at 0x4023C6C: strncmp (strcmp-sse2.S:160)
==41==    by 0x4004BEE: is_dst (dl-load.c:216)
==41==    by 0x40059BE: _dl_dst_count (dl-load.c:253)
==41==
==41== Invalid write of size 4
==41==    at 0xFAD08E8: c10d::AsyncAllreduceWork::allreduce(...) (in libtorch_cpu.so)
==41==    by 0xFACF0FC: c10d::ProcessGroupGloo::runLoop(int) (in libtorch_cpu.so)
==41==    by 0x4F1FBA4: start_thread (pthread_create.c:442)
==41==  Address 0x1a2b3c40 is 16 bytes inside a block of size 64 free'd
==41==    at 0x484B27F: free (vg_replace_malloc.c:872)
==41==
==41== Conditional jump or move depends on uninitialised value(s)
==41==    at 0x102AD065: at::native::topk_kernel(...) (in libtorch_cpu.so)
==41==
==41== Use of uninitialised value of size 8
==41==    at 0x4B0C750: Py_TYPE (object.h:133)
==41==
==41== Use --track-origins=yes to see where uninitialised values come from
==41== ERROR SUMMARY: 4 errors from 4 contexts (suppressed: 0 from 0)
"""


def test_a_write_into_freed_memory_is_heap_misuse_and_the_loader_is_not():
    misuse = memcheck.heap_misuse(LOG)
    assert len(misuse) == 1
    assert misuse[0][0] == "Invalid write of size 4"
    assert any("free'd" in line for line in misuse[0])


def test_the_summary_counts_every_report_by_kind():
    assert memcheck.summary(LOG) == {
        "Invalid read of size N": 1, "Invalid write of size N": 1,
        "Conditional jump or move depends on uninitialised value(s)": 1,
        "Use of uninitialised value of size N": 1}


def test_a_clean_log_has_no_misuse():
    assert memcheck.heap_misuse("==7== Memcheck\n==7== \n==7== ERROR SUMMARY: 0 errors\n") == []
