"""``apply_optimizer_parallel``: the ``ShardedDataParallel`` a ``ParallelConfig`` asks for, on a
whole model or a pipeline rank's stages (``root``: the stage's runner, or one per stage)."""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import nn

from parallel.config import ParallelConfig
from parallel.context import ParallelMode
from parallel.mesh import optimizer_mesh, parallel_mesh
from parallel.optimizer_parallel.sharded import ShardedDataParallel
from parallel.optimizer_parallel.spmd import semi_auto_dims


def apply_optimizer_parallel(model: nn.Module, config: ParallelConfig, *,
                             root: nn.Module | Sequence[nn.Module] | None = None
                             ) -> ShardedDataParallel:
    """Shard ``model``'s optimizer over its data-parallel ranks: the ``dp`` dim of the job's
    mesh, or the batch dims of a semi-auto model's mesh (``config`` is resolved)."""
    if config.mode in (ParallelMode.SEMI_AUTO_PARALLEL, ParallelMode.AUTO_PARALLEL):
        mesh, dims = semi_auto_dims(model, config.data_degree, config.optimizer_weight_shard_size)
        return ShardedDataParallel(model, config.optimizer_level, mesh=mesh, spmd=dims,
                                   threshold_kb=config.parallel_optimizer_threshold, root=root)
    group = (None if config.data_degree == dist.get_world_size()
             else parallel_mesh(config)["dp"].get_group())
    return ShardedDataParallel(model, config.optimizer_level, mesh=optimizer_mesh(config),
                               threshold_kb=config.parallel_optimizer_threshold,
                               gradients_mean=config.gradients_mean,
                               parameter_broadcast=config.parameter_broadcast,
                               param_dtype=config.param_dtype, group=group, root=root)
