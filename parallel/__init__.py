"""hetero-parallel's distributed modes on torch.distributed.

``parallel.init()`` creates the process group (torchrun or a single process), a
``ParallelConfig`` says how the job is parallelised (``data_degree``, ``tensor_degree``,
``pipeline_degree``, ``expert_degree``, ... on one mesh), ``parallelize(model, config)`` applies
it and returns a ``Parallelized`` result, and ``combinations()`` says which features combine. A
model built on the meta device is given storage and values after the split and sharding, each
rank only its share (``parallel.materialize`` is the one-process reference: docs/deferred-init.md);
its values can come from a local checkpoint, each rank reading only its block (``parallelize(...,
weights=path)``, ``parallel.load_weights``).

The top level holds what a training script uses; the rest lives in the submodule named for its
part, imported here: ``parallel.collectives`` (differentiable all_reduce, all_gather, ...),
``parallel.data`` (``DataParallel``, ``ShardSampler``), ``parallel.optimizer_parallel``,
``parallel.pipeline``, ``parallel.semi_auto``, ``parallel.auto`` (planners, cluster plans, device
profiles),
``parallel.context`` (the MindSpore-style ``set_auto_parallel_context`` adapter),
``parallel.config`` (its enums), ``parallel.dims``, ``parallel.expert``, ``parallel.weights``.
The names that used to sit at the top level, and the modules that moved into the package of
their dimension, still work for one release, with a ``DeprecationWarning`` (:data:`MOVED`,
:data:`MOVED_MODULES`).
"""

from foundation.deprecation import moved_modules, moved_names

# the submodules that hold the rest (``parallel.nn.MoE``, ``parallel.collectives.all_reduce``, ...)
from parallel import auto as auto
from parallel import collectives as collectives
from parallel import config as config
from parallel import context as context
from parallel import data as data
from parallel import dims as dims
from parallel import expert as expert
from parallel import nn as nn
from parallel import optimizer_parallel as optimizer_parallel
from parallel import pipeline as pipeline
from parallel import semi_auto as semi_auto
from parallel import weights as weights
from parallel.auto import plan_auto_parallel
from parallel.combinations import combinations
from parallel.comm import (
    barrier,
    destroy,
    get_local_rank,
    get_rank,
    get_world_size,
    init,
    is_initialized,
)
from parallel.config import ParallelConfig
from parallel.data.sharding import shard_dataset
from parallel.errors import CollectiveError
from parallel.hybrid_parallel import mark_model_parallel
from parallel.multi_copy import MultiCopy, multi_copy
from parallel.parallelize import parallelize
from parallel.pipeline import pipeline_stage
from parallel.recompute import recompute, recompute_layers
from parallel.result import Parallelized
from parallel.semi_auto import shard
from parallel.weights.deferred_init import materialize
from parallel.weights.loading import load_weights

__all__ = [
    # the process group
    "init", "destroy", "is_initialized", "get_rank", "get_world_size", "get_local_rank",
    "barrier", "CollectiveError",
    # one config, one door
    "ParallelConfig", "parallelize", "Parallelized", "combinations", "plan_auto_parallel",
    # tags on the model
    "shard", "pipeline_stage", "recompute", "recompute_layers", "mark_model_parallel",
    "multi_copy", "MultiCopy",
    # meta-device models and checkpoints
    "materialize", "load_weights",
    # data
    "shard_dataset",
    # layers
    "nn",
]

#: the previous release's top-level names -> the module each lives in now
MOVED = {
    **dict.fromkeys(("ClusterPlan", "ClusterSpec", "DeviceProfile", "StrategyPlan",
                     "TransformerShape", "plan_cluster", "price_cluster_plan",
                     "profile_devices"), "parallel.auto"),
    **dict.fromkeys(("all_gather", "all_reduce", "all_to_all", "all_to_all_rows", "broadcast",
                     "reduce_scatter"), "parallel.collectives"),
    "get_group_size": "parallel.comm",
    **dict.fromkeys(("OptimizerLevel", "Schedule", "SearchMode"), "parallel.config"),
    **dict.fromkeys(("ParallelMode", "get_auto_parallel_context", "reset_auto_parallel_context",
                     "set_auto_parallel_context"), "parallel.context"),
    **dict.fromkeys(("DataParallel", "ShardSampler", "ShardedIterable"), "parallel.data"),
    "ParallelDims": "parallel.dims",
    "collective_guard": "parallel.errors",
    "parallel_mesh": "parallel.mesh",
    "ShardedDataParallel": "parallel.optimizer_parallel",
    **dict.fromkeys(("Pipeline", "explain_pipeline"), "parallel.pipeline"),
    **dict.fromkeys(("Layout", "explain_sharding"), "parallel.semi_auto"),
}

#: modules that moved into the package of their dimension -> where each lives now (the old
#: spellings import, and read as attributes, with a DeprecationWarning for one release)
MOVED_MODULES = {
    "data_parallel": "parallel.data.replicas", "grad_reducer": "parallel.data.grad_reducer",
    "data_sharding": "parallel.data.sharding", "expert_parallel": "parallel.expert.experts",
    "expert_semi_auto": "parallel.expert.semi_auto", "hybrid": "parallel.compose",
    **{name: f"parallel.weights.{name}" for name in (
        "deferred_init", "deferred_hooks", "deferred_modes", "deferred_spmd")},
    "weights_files": "parallel.weights.files", "weights_match": "parallel.weights.match",
}

_moved_name = moved_names(__name__, MOVED)
_moved_module = moved_modules(__name__, MOVED_MODULES)


def __getattr__(name: str) -> object:
    return (_moved_module if name in MOVED_MODULES else _moved_name)(name)
