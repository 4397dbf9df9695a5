"""Split an offloaded parameter group's pinned host buffers into chunks that waste little.

Pinned host memory comes from the accelerator's caching host allocator, and that allocator rounds
every request up to the next power of two before page-locking it (PyTorch's
``ATen/core/CachingHostAllocator.h``: ``roundSize = c10::llvm::PowerOf2Ceil(size)``, then
``allocate_host_memory(roundSize)``; the CUDA, ROCm and Ascend host allocators derive from it).
One flat pinned buffer of 1.1 GiB therefore pins 2 GiB: up to half of it is waste.

A buffer's parameters must stay contiguous (the host kernel updates a run of neighbours as one
slice, and each parameter is a view), so a buffer is cut only between parameters: consecutive
parameters are grouped into chunks, each its own allocation, and a chunk is closed as soon as its
size is within ``max_waste`` of the power of two it rounds to. The bound, in elements (every
pinned buffer of an arena has the same element count and a power-of-two element size, so the
ratio holds for its bytes too):

    pinned <= (1 + max_waste) * (elements of every chunk but the last) + roundup(last chunk)

that is, the waste is at most ``max_waste`` of the buffer plus the last chunk's own rounding,
which is less than the last chunk (and nothing when the last chunk closed within the bound too).
The host kernel is then called once per chunk rather than once per group: chunks are large
(each near a power of two of the group's parameters), so that is a handful of calls.
:func:`pinned_views` cuts parameter offload's pinned host weights the same way.
"""

from __future__ import annotations

import itertools

import torch

from hetero.optim.host_arena import HostArena

#: Default bound on the rounding waste of every closed chunk (a fraction of its size).
MAX_WASTE = 1 / 16


def rounded(n: int) -> int:
    """What the caching host allocator reserves for a request of ``n`` units: the next power of
    two (``c10::llvm::PowerOf2Ceil``; 0 for 0)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def chunk_sizes(numels: list[int], max_waste: float = MAX_WASTE) -> list[int]:
    """How many consecutive parameters (of ``numels`` elements each) each chunk holds, in
    order; every chunk but the last wastes at most ``max_waste`` of its size to rounding."""
    if not 0 < max_waste < 1:
        raise ValueError(f"max_waste must be in (0, 1), got {max_waste}")
    if any(n < 0 for n in numels):
        raise ValueError(f"parameter sizes must be >= 0, got {numels}")
    sizes: list[int] = []
    count = filled = 0
    for n in numels:
        count, filled = count + 1, filled + n
        if filled and rounded(filled) - filled <= max_waste * filled:
            sizes.append(count)
            count = filled = 0
    if count:
        sizes.append(count)
    return sizes


def pinned_elements(numels: list[int], sizes: list[int]) -> int:
    """Elements the allocator really pins for one buffer split as ``sizes`` says."""
    total, start = 0, 0
    for size in sizes:
        total += rounded(sum(numels[start:start + size]))
        start += size
    return total


def pinned_views(specs: list[tuple[torch.Size, torch.dtype]]) -> list[torch.Tensor]:
    """Host tensors of these shapes and dtypes, pinned where an accelerator copies from them:
    the views of a few arenas (``HostArena``) cut along parameter boundaries
    (:func:`chunk_sizes`, as the offloaded optimizer cuts its own), not one
    allocation each. The caching host allocator rounds every pinned request up to a power of
    two, so one tensor per parameter pinned up to twice the model (Llama-7B's 25.1 GiB of fp32
    weights as 33 GiB); each chunk here wastes at most a sixteenth of itself."""
    views: list[torch.Tensor] = []
    for dtype, run in itertools.groupby(specs, key=lambda spec: spec[1]):
        shapes = [shape for shape, _ in run]
        start = 0
        for count in chunk_sizes([shape.numel() for shape in shapes]):
            arena = HostArena(shapes[start:start + count])
            arena.add("weights", dtype, pinned=True)
            views += [arena.view("weights", index) for index in range(count)]
            start += count
    return views
