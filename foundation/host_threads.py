"""How many host threads a rank's host-side compute (the offloaded optimizer's update) may use.

torchrun sets ``OMP_NUM_THREADS=1`` for every rank when there are several per node, so torch's
intra-op pool runs one thread and the host Adam update — memory-bandwidth bound, and the step's
critical path under optimizer offload — uses one core of many. The right share is the cores this
rank owns:

* the CPU affinity of the process (``os.sched_getaffinity``), when a launcher bound it to fewer
  cores than the machine has (``torchrun --numa-binding``, ``taskset``, SLURM's ``--cpu-bind``):
  those cores are this rank's alone;
* otherwise the visible cores divided by the ranks on this node (``LOCAL_WORLD_SIZE``, which
  torchrun sets), at least one.

The count is applied around the host step only (:func:`thread_scope`): the rest of the step keeps
the thread count the user or launcher chose, so data loading and host partitions are unaffected.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def _available_cores() -> tuple[int, bool]:
    """(cores this process may run on, whether affinity restricts it below the machine)."""
    machine = os.cpu_count() or 1
    if hasattr(os, "sched_getaffinity"):
        allowed = len(os.sched_getaffinity(0))
        return allowed, allowed < machine
    return machine, False


def cores_per_rank(local_world_size: int | None = None) -> int:
    """Host cores this rank owns (see the module docstring); ``local_world_size`` defaults to
    ``$LOCAL_WORLD_SIZE`` (1 outside torchrun)."""
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local_world_size < 1:
        raise ValueError(f"local_world_size must be >= 1, got {local_world_size}")
    cores, bound = _available_cores()
    return max(1, cores if bound else cores // local_world_size)


@contextmanager
def thread_scope(threads: int) -> Iterator[None]:
    """Run the block with ``threads`` intra-op threads, restoring the previous count after."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    previous = torch.get_num_threads()
    if threads == previous:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
