"""hetero-parallel's distributed modes on torch.distributed.

``parallel.init()`` creates the process group (torchrun or a single process), the collectives are
differentiable, a ``ParallelConfig`` says how the job is parallelised (``data_degree``,
``tensor_degree``, ``pipeline_degree``, ``expert_degree``, ... on one mesh: ``ParallelDims``),
``parallelize(model, config)`` applies it and returns a ``Parallelized`` result, and
``combinations()`` says which features combine. A model built on the meta device is given
storage and values after the split and sharding, each rank only its share
(``parallel.materialize`` is the one-process reference: docs/deferred-init.md); its values can
come from a local checkpoint, each rank reading only its block (``parallelize(...,
weights=path)``, ``parallel.load_weights``).
``set_auto_parallel_context`` is the MindSpore-style adapter (``ParallelConfig.from_context()``).
"""

from parallel import nn  # parallel.nn.MoE
from parallel.auto import (
    ClusterPlan,
    ClusterSpec,
    DeviceProfile,
    StrategyPlan,
    TransformerShape,
    plan_auto_parallel,
    plan_cluster,
    price_cluster_plan,
    profile_devices,
)
from parallel.collectives import (
    all_gather,
    all_reduce,
    all_to_all,
    all_to_all_rows,
    broadcast,
    reduce_scatter,
)
from parallel.combinations import combinations
from parallel.comm import (
    barrier,
    destroy,
    get_group_size,
    get_local_rank,
    get_rank,
    get_world_size,
    init,
    is_initialized,
)
from parallel.config import OptimizerLevel, ParallelConfig, Schedule, SearchMode
from parallel.context import (
    ParallelMode,
    get_auto_parallel_context,
    reset_auto_parallel_context,
    set_auto_parallel_context,
)
from parallel.data_parallel import DataParallel
from parallel.data_sharding import ShardedIterable, ShardSampler, shard_dataset
from parallel.deferred_init import materialize
from parallel.dims import ParallelDims
from parallel.errors import CollectiveError, collective_guard
from parallel.hybrid_parallel import mark_model_parallel
from parallel.load_weights import load_weights
from parallel.mesh import parallel_mesh
from parallel.multi_copy import MultiCopy, multi_copy
from parallel.optimizer_parallel import ShardedDataParallel
from parallel.parallelize import parallelize
from parallel.pipeline import Pipeline, explain_pipeline, pipeline_stage
from parallel.recompute import recompute, recompute_layers
from parallel.result import Parallelized
from parallel.semi_auto import Layout, explain_sharding, shard

__all__ = [
    "ClusterPlan",
    "ClusterSpec",
    "TransformerShape",
    "plan_cluster",
    "price_cluster_plan",
    "CollectiveError",
    "DataParallel",
    "ShardedDataParallel",
    "nn",
    "Layout",
    "OptimizerLevel",
    "ParallelConfig",
    "ParallelDims",
    "Parallelized",
    "Schedule",
    "SearchMode",
    "combinations",
    "ParallelMode",
    "Pipeline",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "all_to_all_rows",
    "barrier",
    "broadcast",
    "collective_guard",
    "destroy",
    "explain_pipeline",
    "explain_sharding",
    "get_auto_parallel_context",
    "get_group_size",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init",
    "is_initialized",
    "mark_model_parallel",
    "materialize",
    "load_weights",
    "parallel_mesh",
    "profile_devices",
    "plan_auto_parallel",
    "StrategyPlan",
    "DeviceProfile",
    "multi_copy",
    "MultiCopy",
    "parallelize",
    "recompute",
    "recompute_layers",
    "pipeline_stage",
    "reduce_scatter",
    "reset_auto_parallel_context",
    "set_auto_parallel_context",
    "ShardSampler",
    "ShardedIterable",
    "shard_dataset",
    "shard",
]
