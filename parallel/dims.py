"""``ParallelDims``: a resolved ``ParallelConfig`` and the one world mesh every mode takes its
groups from.

The world mesh has the named dimensions ``("pp", "dp", "ep", "cp", "tp")``, laid out row-major
with ``pp`` outermost as torchtitan does: a pipeline stage's ``data × expert × context × tensor``
ranks are contiguous, so its collectives (gradient AllReduce on ``dp``, semi-auto
redistributions on its stage mesh, MoE all-to-all on ``ep``, ring attention on ``cp``) stay
inside the stage, and stages exchange activations point to point along ``pp``; context and
tensor ranks, which talk inside every layer, are innermost (on one node). Every other mesh a mode
needs is a regrouping of the same ranks (:meth:`ParallelDims.mesh`): the ``batch`` ranks (``dp ×
ep``, which split the batch), the ``replicas`` (``dp × ep × cp``, which average gradients), the
optimizer's ``dp_replicate × dp_shard`` split of ``dp``, and semi-auto's stage mesh (the
coarsest refinement of its strategies' device matrices over a stage's ranks).

Process groups come from :class:`ProcessGroups`, which creates one group per distinct set of
ranks for the life of the process group: torch's ``init_device_mesh`` / ``_flatten`` /
``_unflatten`` each make new groups even for ranks that already have one (each costs a
communicator, on NCCL/HCCL a real amount of device memory), so meshes here are assembled with
``DeviceMesh.from_group`` from the shared groups instead. Building a mesh is collective: every
rank builds the same meshes in the same order (``new_group`` is called for every set, members or
not), which ``parallelize`` guarantees by deriving every mesh from the config alone.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import foundation.device as hd
from foundation.own_groups import own_group
from parallel import nodes
from parallel.config import ParallelConfig

WORLD_DIMS = ("pp", "dp", "ep", "cp", "tp")


class ProcessGroups:
    """One process group per distinct rank set, for the current default process group."""

    _groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
    #: (shape, names) -> its mesh: one object per layout, because FSDP2 compares meshes by
    #: identity, and DTensor's sharding cache hands a tensor an equal mesh built earlier (one
    #: model's parameters would otherwise sit on two mesh objects)
    _meshes: dict[tuple[tuple[int, ...], tuple[str, ...], str, tuple[int, ...]],
                  DeviceMesh] = {}
    _world: object | None = None

    @classmethod
    def _current(cls) -> None:
        if cls._world is not dist.group.WORLD:  # a new (or re-initialised) default group
            cls._groups, cls._meshes = {}, {}
            cls._world = dist.group.WORLD

    @classmethod
    def forget(cls) -> None:
        """Drop every cached group and mesh (``parallel.destroy()``): a group this cache still held
        would outlive ``destroy_process_group`` with its gloo worker threads running."""
        cls._groups, cls._meshes, cls._world = {}, {}, None

    @classmethod
    def dedicated(cls, purpose: str) -> dist.ProcessGroup:
        """A gloo group of every rank used by ``purpose`` alone, created on first use (by every
        rank, at the same point): for collectives issued from another thread while training
        runs (an asynchronous checkpoint's), which must never interleave with the training
        step's on a shared group (``foundation.own_groups``)."""
        group = own_group(None, purpose, backend="gloo")
        return dist.group.WORLD if group is None else group  # one process: its world

    @classmethod
    def get(cls, ranks: Sequence[int]) -> dist.ProcessGroup:
        """The group of ``ranks`` (sorted), created on first use by every rank."""
        cls._current()
        key = tuple(sorted(ranks))
        if len(key) == dist.get_world_size():
            return dist.group.WORLD
        if key not in cls._groups:
            cls._groups[key] = dist.new_group(list(key))
        return cls._groups[key]

    @classmethod
    def created(cls) -> list[tuple[int, ...]]:
        """The rank sets a group was created for (tests count them)."""
        return list(cls._groups) if cls._world is dist.group.WORLD else []


def build_mesh(shape: Sequence[int], names: Sequence[str],
               ranks: torch.Tensor | None = None) -> DeviceMesh:
    """The world's ranks laid out row-major in ``shape`` with dimension ``names`` (or in the
    order of ``ranks``, a permutation of them), on this process's device, its groups taken from
    :class:`ProcessGroups`; built once per default process group (the same object for the same
    layout)."""
    if not dist.is_initialized():
        raise RuntimeError("parallel meshes need the process group: call parallel.init() first "
                           "(it also works in a plain single process)")
    ProcessGroups._current()
    world = dist.get_world_size()
    if math.prod(shape) != world:
        raise ValueError(f"mesh {tuple(shape)} ({', '.join(names)}) needs {math.prod(shape)} "
                         f"ranks, but the job has {world}")
    order = torch.arange(world) if ranks is None else ranks.reshape(-1)
    if sorted(order.tolist()) != list(range(world)):
        raise ValueError(f"mesh ({', '.join(names)}): its ranks must be each of the job's "
                         f"{world} ranks once, got {order.tolist()}")
    key = (tuple(shape), tuple(names), hd.resolve("device").type, tuple(order.tolist()))
    if key not in ProcessGroups._meshes:
        ProcessGroups._meshes[key] = _new_mesh(order.reshape(tuple(shape)), names, key[2])
    return ProcessGroups._meshes[key]


def _new_mesh(ranks: torch.Tensor, names: Sequence[str], device_type: str) -> DeviceMesh:
    shape = ranks.shape
    me = dist.get_rank()
    mine = []
    for dim in range(len(shape)):
        rows = ranks.movedim(dim, -1).reshape(-1, shape[dim]).tolist()
        for row in rows:  # every rank creates every group, in the same order
            group = ProcessGroups.get(row)
            if me in row:
                mine.append(group)
    return DeviceMesh.from_group(mine, device_type, ranks, mesh_dim_names=tuple(names))


class ParallelDims:
    """The resolved config, the world mesh and its named regroupings (see the module doc).

    Made once per ``parallelize`` call (``ParallelDims(config)``) and handed to every ``apply_*``
    step; meshes are built on first use and kept.
    """

    def __init__(self, config: ParallelConfig) -> None:
        if not dist.is_initialized():
            raise RuntimeError("parallel.parallelize needs the process group: call "
                               "parallel.init() first (it also works in a plain single process)")
        self.config = config.resolve(dist.get_world_size())
        self.nodes = nodes.job_nodes(dist.get_world_size())

    def check_nodes(self) -> None:
        """Warn (``strict_nodes``: ValueError) when a tensor or expert group spans nodes
        (``parallel.nodes``); ``parallelize`` calls it before any model change."""
        problems = nodes.spanning_problems(self.shape, WORLD_DIMS, self.nodes)
        if problems and self.config.strict_nodes:
            raise ValueError("ParallelConfig(strict_nodes=True): " + "; ".join(problems))
        for problem in problems:
            warnings.warn(f"parallel layout: {problem}", stacklevel=3)

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """The world mesh's degrees, ``(pp, dp, ep, cp, tp)``."""
        return (self.pp, self.dp, self.ep, self.cp, self.tp)

    # degrees, by the mesh's names
    @property
    def pp(self) -> int:
        return self.config.pipeline_degree

    @property
    def dp(self) -> int:
        return self.config._resolved("dp")

    @property
    def ep(self) -> int:
        return self.config.expert_degree

    @property
    def cp(self) -> int:
        return self.config.context_degree

    @property
    def tp(self) -> int:
        return self.config.tensor_degree

    def mesh(self, shape: Sequence[int], names: Sequence[str],
             ranks: torch.Tensor | None = None) -> DeviceMesh:
        """A regrouping of the world's ranks (row-major in ``shape``, or in the order of
        ``ranks``), built once."""
        return build_mesh(shape, names, ranks)

    @property
    def world_mesh(self) -> DeviceMesh:
        """``(pp, dp, ep, cp, tp)``."""
        return self.mesh(self.shape, WORLD_DIMS)

    def __getitem__(self, name: str | tuple[str, ...]) -> DeviceMesh:
        """A named sub-mesh: a world dimension (``"dp"``), several (``("dp", "tp")``), or the
        regrouped ``"batch"`` (``dp × ep``), ``"replicas"`` (``dp × ep × cp``), ``"stage"``
        (``dp × ep × cp × tp``) and ``"expert_replicas"`` (``dp × cp``: the ranks holding the
        same expert shards)."""
        if name == "batch":
            return self.mesh((self.pp, self.dp * self.ep, self.cp, self.tp),
                             ("pp", "batch", "cp", "tp"))["batch"]
        if name == "replicas":
            return self.mesh((self.pp, self.dp * self.ep * self.cp, self.tp),
                             ("pp", "replicas", "tp"))["replicas"]
        if name == "stage":
            return self.stage_mesh((self.dp * self.ep * self.cp * self.tp,), ("stage",))
        if name == "expert_replicas":  # the ranks holding the same experts: dp × cp
            return self.expert_mesh()["expert_replicas"]
        return self.world_mesh[name]

    def expert_mesh(self) -> DeviceMesh:
        """``(pp, expert_replicas, ep, tp)``: the world's ranks regrouped so that the ranks
        holding the same expert shards (``dp × cp``) are one dimension, before ``ep`` in the same
        mesh: optimizer parallel shards each expert shard over them with FSDP2, which needs the
        experts' ``ep`` mesh and its own to share a root (and DTensor, its 2-D dimensions in the
        root's order)."""
        ranks = torch.arange(dist.get_world_size()).reshape(self.shape).permute(0, 1, 3, 2, 4)
        shape = (self.pp, self.dp * self.cp, self.ep, self.tp)
        return self.mesh(shape, ("pp", "expert_replicas", "ep", "tp"), ranks.reshape(shape))

    def optimizer_mesh(self) -> DeviceMesh:
        """The mesh optimizer parallel shards over, for this rank's ``dp`` ranks: 1-D
        ``("dp_shard",)``, or 2-D ``("dp_replicate", "dp_shard")`` when
        ``optimizer_weight_shard_size`` of them share a shard (``dp`` split in two inside the
        same layout, so its ranks are exactly the ``dp`` dimension's)."""
        if self.cp > 1:  # the data × context replicas share one shard (ep = 1 here)
            return self.mesh((self.pp, self.dp * self.ep * self.cp, self.tp),
                             ("pp", "dp_shard", "tp"))["dp_shard"]
        shard = self.config.optimizer_shard_size
        names = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")
        mesh = self.mesh((self.pp, self.dp // shard, shard, self.ep, self.cp, self.tp), names)
        return mesh["dp_shard"] if shard == self.dp else mesh["dp_replicate", "dp_shard"]

    def stage_mesh(self, shape: Sequence[int], names: Sequence[str]) -> DeviceMesh:
        """A mesh of ``shape`` over this rank's pipeline stage (its ``dp × ep × cp × tp``
        ranks, row-major): semi-auto's refinement of its strategies' device matrices."""
        if math.prod(shape) * self.pp != dist.get_world_size():
            raise ValueError(f"stage mesh {tuple(shape)} × {self.pp} pipeline stage(s) needs "
                             f"{math.prod(shape) * self.pp} ranks, but the job has "
                             f"{dist.get_world_size()}")
        if self.pp == 1:
            return self.mesh(shape, names)
        return self.mesh((self.pp, *shape), ("pp", *names))[tuple(names)]

    def describe(self) -> str:
        """One line: the degrees, this rank's coordinates and the nodes (which dimensions'
        groups stay inside one)."""
        coords = dict(zip(WORLD_DIMS, self.world_mesh.get_coordinate() or (), strict=False))
        degrees = " × ".join(f"{n}={getattr(self, n)}" for n in WORLD_DIMS)
        where = ", ".join(f"{n}{c}" for n, c in coords.items())
        split = self.config.operator_split.value
        return (f"mesh {degrees} (operators: {split}); rank {dist.get_rank()} at {where}; "
                f"{nodes.describe(self.shape, WORLD_DIMS, self.nodes)}")
