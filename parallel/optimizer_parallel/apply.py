"""``apply_optimizer_parallel``: the ``ShardedDataParallel`` a ``ParallelConfig`` asks for, on a
whole model or a pipeline rank's stages (``root``: the stage's runner, or one per stage).

With ``expert_degree > 1`` (or MoE layers under data parallel) the MoE experts are first sharded
over ``ep`` (``parallel.expert.experts.shard_experts``); then the other parameters are sharded
over the ``dp × ep × cp`` ranks that hold tokens and replicate them, and each expert shard over
the ``dp × cp`` ranks that replicate it (``parallel.optimizer_parallel.experts``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import nn

from parallel.config import ParallelConfig
from parallel.context_parallel import ContextParallel
from parallel.dims import ParallelDims
from parallel.expert.experts import moe_layers, shard_experts
from parallel.mesh import optimizer_mesh
from parallel.optimizer_parallel.experts import ExpertShards
from parallel.optimizer_parallel.sharded import ShardedDataParallel
from parallel.optimizer_parallel.spmd import semi_auto_dims


def apply_optimizer_parallel(model: nn.Module, config: ParallelConfig, *,
                             root: nn.Module | Sequence[nn.Module] | None = None
                             ) -> ShardedDataParallel:
    """Shard ``model``'s optimizer over its data-parallel ranks: the ``dp`` dim of the job's
    mesh, or the batch dims of the mesh of a model split by strategies (``config`` is resolved),
    whose gradients are then also averaged over the context ranks of a sequence split (each
    holds the same shards: the optimizer state is 1/(dp·tp), not 1/(dp·cp·tp))."""
    if config.shards_operators:  # over the strategies' data ranks, averaged over cp's
        inner = model.module if isinstance(model, ContextParallel) else model
        mesh, dims = semi_auto_dims(inner, config.data_degree, config.optimizer_weight_shard_size)
        context = (ParallelDims(config)["cp"].get_group() if config.context_degree > 1
                   else None)
        return ShardedDataParallel(model, config.optimizer_level, mesh=mesh, spmd=dims,
                                   threshold_kb=config.parallel_optimizer_threshold, root=root,
                                   context_group=context)
    if config.expert_degree > 1 or moe_layers(model):
        return _with_experts(model, config, root)
    group = (None if config.replica_ranks == dist.get_world_size()  # data × context ranks
             else ParallelDims(config)["replicas"].get_group())
    return ShardedDataParallel(model, config.optimizer_level, mesh=optimizer_mesh(config),
                               threshold_kb=config.parallel_optimizer_threshold,
                               gradients_mean=config.gradients_mean,
                               parameter_broadcast=config.parameter_broadcast,
                               param_dtype=config.param_dtype, group=group, root=root,
                               offload_params=config.offload_params)


def _with_experts(model: nn.Module, config: ParallelConfig,
                  root: nn.Module | Sequence[nn.Module] | None) -> ShardedDataParallel:
    """Expert parallel set-up, then optimizer parallel over the batch ranks with the experts on
    their own ``dp × cp`` mesh (see the module docstring)."""
    # a meta model stays meta until FSDP2 has sharded it (ShardedDataParallel allocates)
    layers = shard_experts(model, config, require=root is None, materialize=False)
    dims = ParallelDims(config)
    # the rest over every rank holding tokens: dp × ep (the batch mesh, as explain() names it),
    # × cp under a sequence split
    replicas = dims["replicas"] if dims.cp > 1 else dims["batch"]
    experts = ExpertShards(tuple(moe.experts for _, moe in layers),
                           dims.expert_mesh()["expert_replicas"], config.expert_degree,
                           config.gradients_mean)
    return ShardedDataParallel(model, config.optimizer_level, mesh=replicas,
                               threshold_kb=config.parallel_optimizer_threshold,
                               gradients_mean=config.gradients_mean,
                               parameter_broadcast=config.parameter_broadcast,
                               group=(None if config.replica_ranks == dist.get_world_size()
                                      else replicas.get_group()),
                               root=root, experts=experts)
