"""From layouts to torch DTensor: one DeviceMesh for a model, placements for each layout.

Every operator has its own device matrix (MatMul ``((2, 1), (1, 2))`` on 4 devices is
``(2, 1, 2)``, a LayerNorm ``((2, 1, 1),)`` is ``(2, 2, 1, 1)`` with its repeat axis), but DTensor
can only redistribute between tensors on the same ``DeviceMesh``. All device matrices arrange the
same ranks row-major, so each axis is a contiguous block of "rank strides"; the mesh used here is
their coarsest common refinement: its dimensions are cut wherever any device matrix has an axis
boundary. Every layout is then expressible on it: a device-matrix axis becomes one or more
consecutive mesh dimensions, a tensor dimension sliced by that axis becomes ``Shard(dim)`` on
each of them (DTensor splits over earlier mesh dimensions first, which is the row-major order of
the reference), partial axes become ``Partial()``, and every other mesh dimension ``Replicate()``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from parallel.dims import build_mesh
from parallel.semi_auto.layout import TensorLayout, dim_axes


def _cuts(device_matrix: Sequence[int]) -> set[int]:
    """Rank strides at which ``device_matrix``'s axes begin and end (suffix products)."""
    cuts, stride = {1}, 1
    for size in reversed(device_matrix):
        stride *= size
        cuts.add(stride)
    return cuts


def _mesh_cuts(mesh_shape: Sequence[int]) -> list[int]:
    """Suffix products of a mesh shape: element j is the stride of mesh dimension j - 1."""
    return [math.prod(mesh_shape[j:]) for j in range(len(mesh_shape) + 1)]


def mesh_shape_for(device_matrices: Iterable[Sequence[int]], device_num: int) -> tuple[int, ...]:
    """The coarsest mesh shape on which every device matrix (each over ``device_num``) fits."""
    cuts = {1, device_num}
    for matrix in device_matrices:
        if math.prod(matrix) != device_num:
            raise ValueError(f"device matrix {tuple(matrix)} does not cover the {device_num} "
                             f"devices")
        cuts |= _cuts(matrix)
    ordered = sorted(cuts)
    for small, big in zip(ordered, ordered[1:], strict=False):
        if big % small:
            raise ValueError(f"device matrices {sorted(map(tuple, device_matrices))} cannot share "
                             f"one device mesh: axis boundaries at rank strides {small} and {big} "
                             f"do not nest")
    shape = tuple(big // small for small, big in zip(ordered, ordered[1:], strict=False))[::-1]
    return shape or (1,)


def axis_mesh_dims(device_matrix: Sequence[int],
                   mesh_shape: Sequence[int]) -> dict[int, tuple[int, ...]]:
    """For each axis (counted from the right), the mesh dimensions it spans."""
    strides = _mesh_cuts(mesh_shape)
    found: dict[int, tuple[int, ...]] = {}
    low = 1
    for axis, size in enumerate(reversed(device_matrix)):
        high = low * size
        if size > 1 and (low not in strides or high not in strides):
            raise ValueError(f"device matrix {tuple(device_matrix)} does not fit the "
                             f"device mesh {tuple(mesh_shape)} of its inputs; give parallelize "
                             f"the model that holds this operator so the mesh is built for it")
        found[axis] = tuple(j for j in range(len(mesh_shape))
                            if mesh_shape[j] > 1 and low <= strides[j + 1] and strides[j] <= high)
        low = high
    return found


def placements(layout: TensorLayout, mesh_shape: Sequence[int],
               what: str = "layout") -> tuple[Placement, ...]:
    """The DTensor placements of ``layout`` on a mesh of ``mesh_shape`` (computed once)."""
    try:
        return _placements(layout, tuple(mesh_shape))
    except ValueError as err:
        raise ValueError(f"{what}: {err}") from None


@functools.lru_cache(maxsize=4096)
def _placements(layout: TensorLayout, mesh_shape: tuple[int, ...]) -> tuple[Placement, ...]:
    dims = axis_mesh_dims(layout.device_matrix, mesh_shape)
    result: list[Placement] = [Replicate()] * len(mesh_shape)
    for tensor_dim, entry in enumerate(layout.tensor_map):
        for axis in dim_axes(entry):
            for j in dims[axis]:
                result[j] = Shard(tensor_dim)
    for axis in layout.partial:
        for j in dims[axis]:
            result[j] = Partial()
    return tuple(result)


@functools.lru_cache(maxsize=4096)
def mesh_dims_used(layouts: tuple[TensorLayout, ...],
                   mesh_shape: tuple[int, ...]) -> frozenset[int]:
    """Mesh dimensions along which any of ``layouts`` is split (the operator's work is divided)."""
    used: set[int] = set()
    for layout in layouts:
        dims = axis_mesh_dims(layout.device_matrix, mesh_shape)
        for entry in layout.tensor_map:
            for axis in dim_axes(entry):
                used.update(dims[axis])
    return frozenset(used)


def device_mesh(mesh_shape: tuple[int, ...], pipeline: int = 1, context: int = 1,
                tensor: int = 1) -> DeviceMesh:
    """A DeviceMesh of ``mesh_shape`` over this pipeline stage's ranks (all ranks when
    ``pipeline`` is 1) on this process's device, built once per process group (building one is
    collective: every rank creates the same meshes in order). With ``pipeline`` stages the world
    mesh is ``(pp, *mesh_shape)`` and this rank's stage is its sub-mesh. With ``context`` ranks
    splitting the sequence (the world mesh's ``cp``, just outside its ``tensor`` ranks:
    ``parallel.dims``), the strategies spread over the stage's ranks that share this rank's
    ``cp`` coordinate, in their world order: each context rank runs the same sharded model on
    its part of the sequence."""
    if not dist.is_initialized():
        raise RuntimeError("semi-auto parallel needs the process group: call parallel.init() "
                           "first (it also works in a plain single process)")
    stage = math.prod(mesh_shape)
    if pipeline * context * stage != dist.get_world_size():
        raise ValueError(f"device mesh {tuple(mesh_shape)} × {pipeline} pipeline stage(s)"
                         f"{f' × {context} context ranks' if context > 1 else ''} needs "
                         f"{pipeline * context * stage} ranks, but the job has "
                         f"{dist.get_world_size()}")
    names = tuple(f"sa{j}" for j in range(len(mesh_shape)))
    if context > 1:
        if stage % tensor:
            raise ValueError(f"device mesh {tuple(mesh_shape)}: tensor degree {tensor} does "
                             f"not divide its {stage} ranks")
        world = torch.arange(dist.get_world_size()).reshape(pipeline, stage // tensor, context,
                                                           tensor)
        ranks = world.transpose(1, 2).reshape(pipeline, context, *mesh_shape)
        return build_mesh(ranks.shape, ("pp", "cp", *names), ranks)[names]
    if pipeline == 1:
        return build_mesh(tuple(mesh_shape), names)
    return build_mesh((pipeline, *mesh_shape), ("pp", *names))[names]


def describe_transition(src: Sequence[Placement], dst: Sequence[Placement]) -> list[str]:
    """The collective each mesh dimension needs to go from ``src`` to ``dst`` placements."""
    comms = []
    for j, (a, b) in enumerate(zip(src, dst, strict=True)):
        if a == b:
            continue
        if a.is_partial():
            name = "AllReduce" if b.is_replicate() else "ReduceScatter" if b.is_shard() else None
        elif a.is_shard():
            name = "AllGather" if b.is_replicate() else "AlltoAll" if b.is_shard() else None
        else:
            name = None  # Replicate -> Shard/Partial: each rank keeps its part, no communication
        if name:
            comms.append(f"{name}(mesh dim {j}: {a} -> {b})")
    return comms
