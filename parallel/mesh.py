"""The job's one ``DeviceMesh``: named dimensions ``("pp", "dp", "ep", "mp")`` built from a
``ParallelConfig``.

Ranks are laid out row-major with ``pp`` outermost, as torchtitan does: a pipeline stage's
``data × expert × model`` ranks are contiguous, so its collectives (gradient AllReduce on ``dp``,
semi-auto redistributions on ``dp × mp``, MoE all-to-all on ``ep``) stay inside the stage and
stages only exchange activations point to point along ``pp``. The batch is split over
``dp × ep`` (:func:`batch_mesh`): expert parallel ranks feed their own tokens, as MindSpore's
``expert_parallel`` is a part of ``data_parallel``. Every rank builds the same meshes in the same
order (building one is collective), and a mesh is built once per process group.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import hetero.device as hd
from parallel.config import ParallelConfig

MESH_DIMS = ("pp", "dp", "ep", "mp")
_MESHES: dict[tuple, DeviceMesh] = {}


def parallel_mesh(config: ParallelConfig) -> DeviceMesh:
    """The ``(pp, dp, ep, mp)`` mesh of a resolved ``config`` (needs ``parallel.init()``)."""
    if not dist.is_initialized():
        raise RuntimeError("parallel_mesh needs the process group: call parallel.init() first "
                           "(it also works in a plain single process)")
    if config.data is None:
        config = config.resolve(dist.get_world_size())
    shape = (config.pipeline, config.data, config.expert, config.model)
    return cached_mesh(shape, MESH_DIMS)


def batch_mesh(config: ParallelConfig) -> DeviceMesh:
    """The 1-D mesh of this rank's ``dp × ep`` ranks, which split the batch between them (the
    ``dp`` dimension when ``expert`` is 1); built as the two merged inside the same row-major
    layout, so rank ``i`` of it feeds slice ``i`` of the batch."""
    if config.data is None:
        config = config.resolve(dist.get_world_size())
    if config.expert == 1:
        return parallel_mesh(config)["dp"]
    shape = (config.pipeline, config.data * config.expert, config.model)
    return cached_mesh(shape, ("pp", "batch", "mp"))["batch"]


def optimizer_mesh(config: ParallelConfig) -> DeviceMesh:
    """The mesh optimizer parallel shards over, for this rank's ``dp`` ranks: 1-D
    ``("dp_shard",)``, or 2-D ``("dp_replicate", "dp_shard")`` when
    ``optimizer_weight_shard_size`` of them share a shard. Built as ``dp`` split in two inside
    the same row-major layout, so its ranks are exactly the ``dp`` dimension's."""
    if config.data is None:
        config = config.resolve(dist.get_world_size())
    shard = config.optimizer_shard_size
    names = ("pp", "dp_replicate", "dp_shard", "mp")
    mesh = cached_mesh((config.pipeline, config.data // shard, shard, config.model), names)
    return mesh["dp_shard"] if shard == config.data else mesh["dp_replicate", "dp_shard"]


def cached_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """``init_device_mesh`` on this process's device, once per (shape, names, process group)."""
    device_type = hd.resolve("device").type
    key = (device_type, tuple(shape), tuple(names), dist.group.WORLD)
    if key not in _MESHES:
        for stale in [k for k in _MESHES if k[3] is not dist.group.WORLD]:
            del _MESHES[stale]  # meshes of an earlier (destroyed) process group are dead
        _MESHES[key] = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
    return _MESHES[key]
