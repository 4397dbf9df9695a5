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
:func:`parallel.deferred_init.materialize_pending` (after the last step) fills each block by its
global offset from the tensor's full value generated on the host, one tensor at a time — so a
rank's set-up peak is its share plus one tensor, and its blocks are bitwise the slices of
``parallel.materialize`` in one process. Nothing is left on the meta device, so
``materialize_pending`` allocates nothing more (its ``to_empty`` would replace the parameters'
storage and drop the hooks semi-auto registered).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, distribute_tensor


def empty_dtensor(meta: torch.Tensor, mesh: DeviceMesh,
                  placements: Sequence[Placement]) -> DTensor:
    """A DTensor of ``meta``'s global shape and dtype laid out by ``placements`` on ``mesh``,
    holding uninitialized storage for this rank's block only (``meta`` must be on the meta
    device: deferred initialization fills the block later). No collective."""
    if not meta.is_meta:
        raise ValueError(f"empty_dtensor: expected a meta-device tensor, got one on "
                         f"{meta.device}")
    layout = distribute_tensor(meta, mesh, list(placements), src_data_rank=None)
    local = torch.empty_like(layout.to_local(), device=mesh.device_type)
    return DTensor.from_local(local, mesh, list(placements), run_check=False,
                              shape=layout.shape, stride=layout.stride())


def empty_replicated(meta: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Uninitialized storage of ``meta``'s shape on ``mesh``'s device (a buffer semi-auto then
    replicates; deferred initialization fills it whole)."""
    return torch.empty_like(meta, device=mesh.device_type)
