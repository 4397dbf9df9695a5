"""Optimizer parallel: the optimizer's state, gradients and weights sharded over data-parallel
replicas (MindSpore's ``enable_parallel_optimizer`` levels), see :mod:`.sharded`."""

from parallel.optimizer_parallel.sharded import ShardedDataParallel, shard_mesh

__all__ = ["ShardedDataParallel", "shard_mesh"]
