"""Host memory a training process frees goes back to the system: glibc's mmap threshold pinned.

Why (issue 36): glibc serves an allocation below its *mmap threshold* from its heap arenas and
keeps a freed block's pages there for the next allocation. The threshold starts at 128 KiB and
rises to the size of every mmapped block freed (up to 32 MiB), so once a rank frees the whole
model it built before sharding it (or a layer's gathered weights), every later tensor up to that
size comes from the arenas, and their pages stay in the process: a 100 M-parameter GPT under
optimizer parallel level3 on 2 ranks peaked at 1.39-1.67 GiB per rank through ``recipes/train.py``
and at 1.21-1.26 GiB with the threshold pinned, the library's figure (``benchmarks/memory_scale.py``
pins it for its ranks too). PyTorch's CPU allocator has no cache of its own to release: it calls
``posix_memalign`` and ``free``, so glibc's setting is the one that decides.

The threshold is pinned at 1 MiB, not glibc's 128 KiB: every block above it is a fresh mapping
whose pages the kernel zeroes, and at 128 KiB the default recipe's small activations paid that on
each step (its throughput fell to 0.73x; at 1 MiB it is unchanged). Pinning it also stops glibc
adapting its trim threshold, which then stays at its 128 KiB default.

Nothing is done where the C library is not glibc, or where the user set ``MALLOC_MMAP_THRESHOLD_``
(glibc read it at start-up: theirs wins).
"""

from __future__ import annotations

import ctypes
import os
import platform

MMAP_THRESHOLD_BYTES = 1 << 20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
_USER_SETTING = "MALLOC_MMAP_THRESHOLD_"


def pin_mmap_threshold(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Serve every host allocation above ``nbytes`` from its own mapping, returned to the system
    when freed. True when set; False where the C library is not glibc or the user's
    ``MALLOC_MMAP_THRESHOLD_`` already decides. Process-wide: call it once, early."""
    if nbytes <= 0:
        raise ValueError(f"pin_mmap_threshold(nbytes={nbytes}): the threshold must be positive")
    if _USER_SETTING in os.environ or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL("libc.so.6")
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(nbytes)))
