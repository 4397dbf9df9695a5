"""Sharded parameters held in 16 bits, with their FP32 values kept for the optimizer (ZeRO-Offload).

``ShardedDataParallel(param_dtype=torch.bfloat16)`` casts the model before FSDP2 shards it (FSDP2
gathers in the dtype a parameter was sharded with; it cannot change afterwards), so the device
holds 2 bytes per element per shard and all-gathers half the bytes. Casting first would lose the
FP32 values an offloading optimizer seeds its masters from, so each rank keeps its own FP32 slice
(the rows FSDP2 gives it: ``torch.chunk`` over the shard ranks) in host memory and attaches it to
the sharded parameter; ``hetero.optim.OffloadAdamW`` seeds its master from it and drops it. The
same run then matches the unsharded ``OffloadAdamW(param_dtype=...)`` bit for bit.

A meta-device model (deferred initialization) has no values to keep at the cast: its meta
parameters are cast alone, and each one's FP32 block is kept as deferred initialization
generates it after sharding (:func:`fp32_keeper`), the same rows of the same values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hetero.local_parts import FP32_SEED_ATTR, local


def cast_keeping_fp32(module: nn.Module, dtype: torch.dtype, sharded: set[str],
                      shard_rank: int, shard_count: int) -> dict[str, torch.Tensor]:
    """Cast ``module``'s floating-point parameters to ``dtype``; return, per name, this rank's
    FP32 values on the host (its ``Shard(0)`` slice for names in ``sharded``, else all). A meta
    parameter (deferred initialization) is cast without values: :func:`fp32_keeper` collects
    them as it is initialized."""
    seeds = {}
    with torch.no_grad():
        for name, p in module.named_parameters():
            if not p.is_floating_point() or p.dtype == dtype:
                continue
            if p.is_meta:
                p.data = p.data.to(dtype)
                continue
            values = p.detach()
            if name in sharded:
                chunks = torch.chunk(values, shard_count, dim=0)
                values = chunks[shard_rank] if shard_rank < len(chunks) else values[:0]
            seeds[name] = values.to("cpu", torch.float32, copy=True)
            p.data = p.data.to(dtype)
    return seeds


def fp32_keeper(module: nn.Module, dtype: torch.dtype, seeds: dict[str, torch.Tensor]
                ) -> Callable[[str, torch.Tensor, torch.Tensor], None]:
    """For ``materialize_pending(keep=...)``: each 16-bit parameter's generated FP32 block (the
    rank's shard, as the parameter holds it) is put in ``seeds`` under its name."""
    params = {name for name, p in module.named_parameters() if p.dtype == dtype}

    def keep(name: str, tensor: torch.Tensor, block: torch.Tensor) -> None:
        if name in params and block.is_floating_point() and block.dtype != dtype:  # was cast
            seeds[name] = block.to("cpu", torch.float32, copy=True)
    return keep


def attach_fp32(module: nn.Module, seeds: dict[str, torch.Tensor]) -> None:
    """Attach each seed to its (now sharded) parameter, where it is exactly the parameter's
    values before the cast (a different split would be refused here, not silently used)."""
    for name, p in module.named_parameters():
        seed = seeds.get(name)
        mine = local(p).detach()
        if seed is not None and seed.shape == mine.shape and torch.equal(
                seed.to(mine.dtype), mine.cpu()):
            setattr(p, FP32_SEED_ATTR, seed)
