"""What one rank holds of a parameter, shared by ``hetero.optim`` and ``parallel`` (no imports of
either, so both can use it without an import cycle).

* :func:`local` — the local shard of a ``DTensor`` (optimizer parallel's ``Shard(0)`` parameters
  and gradients), else the tensor itself.
* :data:`FP32_SEED_ATTR` — a 16-bit parameter may carry its FP32 values (this rank's part) under
  this attribute, set by whoever cast it (``parallel.ShardedDataParallel(param_dtype=...)``); an
  offloading optimizer seeds its master from it rather than from the rounded weights, then drops
  it.
"""

from __future__ import annotations

import torch

try:  # torch.distributed is optional in a torch build; without it there are no DTensors
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = ()  # type: ignore[assignment,misc]

FP32_SEED_ATTR = "_hetero_fp32_seed"


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a ``DTensor``, else ``t`` itself."""
    return t._local_tensor if isinstance(t, DTensor) else t
