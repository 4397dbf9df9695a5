"""A process group of its own for each part of a model that issues collectives inside backward
from a thread of its own.

Why: on an accelerator the autograd engine runs a backward's device operations on its device
thread and its host operations on the thread that called ``backward``, at the same time. A group
matches collectives by the order ranks issue them, so two parts issuing on one group from two
threads (a host table's gradient push on the calling thread, its device row cache's all-reduce on
the device thread, the data-parallel reducer's buckets from whichever thread fills one) meet in an
order that can differ between ranks: a hang, or one rank's tensor summed with another's. Each such
part issues on a group of the same ranks that only it uses, where its collectives come in graph
order from one thread. torch's collectives offer no per-thread ordering of their own. The same
holds for collectives issued from a thread of the project's own while training runs (an
asynchronous checkpoint's writes: ``parallel.dims.ProcessGroups.dedicated``).

Beside ``parallel.dims.ProcessGroups`` (one group per rank set, for the layouts' meshes), this is
the one other maker of groups: ``hetero`` builds them too and sits below ``parallel``.

Groups are made once per (purpose, ranks) and kept until ``parallel.destroy`` forgets them
(:func:`forget`): torch keeps every group it created for the life of the world, so a group per
model would pile up worker threads and sockets in a process that builds many.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from foundation.compat import all_gather_single

_groups: dict[tuple[str, tuple[int, ...], str | None], dist.ProcessGroup] = {}
_world: object | None = None


def own_group(group: dist.ProcessGroup | None, purpose: str, backend: str | None = None
              ) -> dist.ProcessGroup | None:
    """A group of ``group``'s ranks (None: the world) that only ``purpose`` issues on, with the
    world's backends (or ``backend``); ``group`` itself in one process or where there is no
    process group.

    Collective on first use for a purpose: every rank of the world calls it at the same point
    (as it builds the same model), each with its own group of the layout; the groups of every
    rank set the layout has are made then, in the same order on every rank, as
    ``dist.new_group`` requires."""
    global _groups, _world
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return group
    if _world is not dist.group.WORLD:  # a new (or re-initialised) world
        _groups, _world = {}, dist.group.WORLD
    mine = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    key = (purpose, mine, backend)
    if key not in _groups:
        world = dist.get_world_size()
        layouts: list[tuple[int, ...]] = [mine]
        if len(mine) < world:  # each rank's own group of this layout, every one made
            row = torch.full((world,), -1, dtype=torch.int64)
            row[:len(mine)] = torch.tensor(mine)
            rows = torch.empty(world * world, dtype=torch.int64)
            all_gather_single(rows, row)  # on the world's host backend: no pickles
            layouts = sorted({tuple(r for r in ranks if r >= 0)
                              for ranks in rows.view(world, world).tolist()})
        for ranks in layouts:
            made = dist.new_group(list(ranks), backend=backend, group_desc=purpose)
            if ranks == mine:
                _groups[key] = made
    return _groups[key]


def forget() -> None:
    """Drop the groups made here (``parallel.destroy``): they are freed with the world."""
    global _groups, _world
    _groups, _world = {}, None
