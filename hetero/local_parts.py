"""What one rank holds of a parameter, shared by ``hetero.optim`` and ``parallel`` (no imports of
either, so both can use it without an import cycle).

* :func:`local` — the local shard of a ``DTensor`` (optimizer parallel's ``Shard(0)`` parameters
  and gradients), else the tensor itself.
* :data:`FP32_SEED_ATTR` — a 16-bit parameter may carry its FP32 values (this rank's part) under
  this attribute, set by whoever cast it (``ShardedDataParallel(param_dtype=...)``); an
  offloading optimizer seeds its master from it rather than from the rounded weights, then drops
  it.
* :data:`DTENSOR_COMPUTE_ATTR` — set (True) on a ``DTensor`` parameter that the model computes
  with directly, through DTensor's dispatch (semi-auto parallel): autograd accumulates its
  gradient into it (so a post-accumulate-grad hook sees it, after the owner's reduction hook)
  and its dtype may change under its placements (:func:`computes_with_dtensor`). Parameters
  sharded by FSDP2 lack it: their gradients are assigned by a reduce-scatter and they are
  gathered in the dtype they were sharded with.
"""

from __future__ import annotations

import torch

try:  # torch.distributed is optional in a torch build; without it there are no DTensors
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = ()  # type: ignore[assignment,misc]

FP32_SEED_ATTR = "_hetero_fp32_seed"
DTENSOR_COMPUTE_ATTR = "_hetero_dtensor_compute"


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a ``DTensor``, else ``t`` itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def computes_with_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor parameter the model computes with directly (see
    :data:`DTENSOR_COMPUTE_ATTR`)."""
    return isinstance(t, DTensor) and getattr(t, DTENSOR_COMPUTE_ATTR, False) is True
