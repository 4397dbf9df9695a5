"""Mesh helpers of the previous release, now views of :class:`parallel.dims.ParallelDims`.

``parallelize`` builds one ``ParallelDims`` per call and hands it to every step; these functions
remain for code that holds only a config (each builds its meshes from the same shared process
groups, so no group is created twice). The world mesh's model dimension is named ``"tp"``.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.device_mesh import DeviceMesh

from parallel.config import ParallelConfig
from parallel.dims import WORLD_DIMS, ParallelDims, build_mesh

MESH_DIMS = WORLD_DIMS


def parallel_mesh(config: ParallelConfig) -> DeviceMesh:
    """The ``(pp, dp, ep, cp, tp)`` mesh of ``config`` (needs ``parallel.init()``)."""
    return ParallelDims(config).world_mesh


def batch_mesh(config: ParallelConfig) -> DeviceMesh:
    """The 1-D mesh of this rank's ``dp × ep`` ranks, which split the batch between them; rank
    ``i`` of it feeds slice ``i`` of the batch."""
    return ParallelDims(config)["batch"]


def optimizer_mesh(config: ParallelConfig) -> DeviceMesh:
    """The mesh optimizer parallel shards over (``ParallelDims.optimizer_mesh``)."""
    return ParallelDims(config).optimizer_mesh()


def cached_mesh(shape: Sequence[int], names: Sequence[str]) -> DeviceMesh:
    """The world's ranks row-major in ``shape`` (built once; groups shared with every other
    mesh)."""
    return build_mesh(shape, names)
