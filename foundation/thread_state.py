"""The per-thread device state a worker thread must take over from the thread that hands it
work: the current accelerator index, the current stream, the autocast state and the number of
intra-op threads.

All three are thread-local in torch. A fresh thread issues work to device 0 on its default
stream with autocast off, so work handed to a helper thread (the host partitions of a placed
model, ``hetero/placement/runtime.py``) would otherwise resolve "device" to device 0 on ranks
1..N-1 of a node, order its copies against the wrong stream and compute in FP32 inside the
caller's ``torch.autocast`` region. :func:`capture` reads the caller's state, :func:`applied`
re-enters it on the worker for one piece of work and restores the worker's own afterwards.

The intra-op thread count is thread-local too: ``torch.set_num_threads`` sets the calling
thread's OpenMP count and the default for threads that start later, but a worker that already ran
keeps the count it started with. A host partition's reductions and matmuls split their work by
that count, so the same call could give results that differ in the last bits depending on which
thread ran it (a host partition runs on the caller when there is nothing to overlap, else on the
worker). The worker takes the caller's count (and keeps it: setting it back would also reset the
default for new threads, undoing the user's ``set_num_threads``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch

from foundation import device as hd


@dataclasses.dataclass(frozen=True)
class ThreadState:
    """One thread's device state: accelerator index (None: no accelerator), current stream
    there, and per device type whether autocast is on and in which dtype."""

    device_index: int | None
    stream: torch.Stream | None
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    autocast_cache: bool
    intra_op_threads: int = 0  # 0: leave the worker's as it is


def capture() -> ThreadState:
    """The calling thread's device state."""
    index = hd.current_device_index()
    stream = hd.current_stream(hd.accelerator()) if index is not None else None
    autocast = tuple((kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
                     for kind in hd.autocast_device_types())
    return ThreadState(index, stream, autocast, torch.is_autocast_cache_enabled(),
                       torch.get_num_threads())


@contextmanager
def applied(state: ThreadState) -> Iterator[None]:
    """Run the body of the ``with`` under ``state`` (captured on another thread)."""
    if state.intra_op_threads and torch.get_num_threads() != state.intra_op_threads:
        torch.set_num_threads(state.intra_op_threads)
    with ExitStack() as stack:
        stack.enter_context(hd.device_index_scope(state.device_index))
        stack.enter_context(hd.stream_scope(state.stream))
        for kind, enabled, dtype in state.autocast:
            stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled,
                                               cache_enabled=state.autocast_cache))
        yield
