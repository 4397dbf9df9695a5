"""Deferred initialization under semi-auto and auto parallel: a meta parameter becomes a DTensor of
its layout with storage for this rank's block only, never the whole tensor.

Semi-auto (and auto, which applies its plan as semi-auto) builds a parameter's DTensor with
``distribute_tensor`` from rank 0's full value. A meta parameter has no value, and the rank may
not afford the whole tensor, so instead:

1. ``distribute_tensor`` on the meta tensor with ``src_data_rank=None`` (no broadcast or scatter:
   each rank cuts its own block locally) gives the DTensor's global shape, stride and this rank's
   local shape, all without storage;
2. an *empty* local block of that shape is allocated on the mesh's device and wrapped with
   ``DTensor.from_local`` (no check collective) in the same placements.

The DTensor is then final: semi-auto attaches its gradient hooks and attributes to it, and
:func:`parallel.weights.deferred_init.materialize_pending` (after the last step) fills each block
by its global offset from the tensor's full value generated on the host, one tensor at a time — so a
rank's set-up peak is its share plus one tensor, and its blocks are bitwise the slices of
``parallel.materialize`` in one process. Nothing is left on the meta device, so
``materialize_pending`` allocates nothing more.

Under optimizer parallel the blocks stay on the meta device instead (:func:`meta_blocks`): FSDP2
shards each DTensor again along the data-parallel dims (``parallel.optimizer_parallel.spmd``),
and allocating the semi-auto block first would put the rank's whole ``1/mp`` share in memory
before FSDP2 cuts it to ``1/(dp × mp)``. The DTensors are then built on meta local blocks (step 1
alone), FSDP2 shards them as shapes, and ``materialize_pending`` gives storage to the rank's
FSDP2 shards only (``to_empty``; the hooks semi-auto registered on the parameters FSDP2 leaves
replicated are kept: ``parallel.weights.deferred_hooks``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, distribute_tensor

_META_BLOCKS: ContextVar[bool] = ContextVar("deferred_spmd_meta_blocks", default=False)


@contextmanager
def meta_blocks(active: bool = True) -> Iterator[None]:
    """Inside (when ``active``), :func:`empty_dtensor` leaves the rank's block on the meta device
    (a later step shards it again and allocates the result: optimizer parallel)."""
    token = _META_BLOCKS.set(active)
    try:
        yield
    finally:
        _META_BLOCKS.reset(token)


def empty_dtensor(meta: torch.Tensor, mesh: DeviceMesh,
                  placements: Sequence[Placement]) -> DTensor:
    """A DTensor of ``meta``'s global shape and dtype laid out by ``placements`` on ``mesh``,
    holding uninitialized storage for this rank's block only (``meta`` must be on the meta
    device: deferred initialization fills the block later); inside :func:`meta_blocks` the
    block stays on the meta device. No collective."""
    if not meta.is_meta:
        raise ValueError(f"empty_dtensor: expected a meta-device tensor, got one on "
                         f"{meta.device}")
    layout = distribute_tensor(meta, mesh, list(placements), src_data_rank=None)
    local = layout.to_local()
    if not _META_BLOCKS.get():
        local = torch.empty_like(local, device=mesh.device_type)
    # from_local on ``mesh`` itself: FSDP2 compares meshes by identity, and the layout may carry
    # an equal mesh an earlier call cached
    return DTensor.from_local(local, mesh, list(placements), run_check=False,
                              shape=layout.shape, stride=layout.stride())


def empty_replicated(meta: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Uninitialized storage of ``meta``'s shape on ``mesh``'s device (a buffer semi-auto then
    replicates; deferred initialization fills it whole)."""
    return torch.empty_like(meta, device=mesh.device_type)
