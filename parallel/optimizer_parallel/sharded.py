"""``ShardedDataParallel``: data parallel whose optimizer state, gradients and (at
level3) weights are sharded over the replicas — the reference's optimizer parallelism.

Built on torch FSDP2 (``fully_shard``), not on our ``GradReducer``: FSDP2 already turns every
parameter into a ``Shard(0)`` DTensor over the shard mesh, so *any* ``torch.optim`` optimizer
built on ``model.parameters()`` keeps only its rank's slice of the state; it reduce-scatters
gradients per unit and prefetches the next unit's all-gather (overlapped on its own streams
where the device has them), shards over a 2-D (replicate, shard) mesh for
``optimizer_weight_shard_size``, and its DTensors make gradient norms global and DCP
checkpoints re-shardable. What FSDP2 does not do, this module adds: MindSpore's levels, the
size threshold (small parameters stay replicated, and *their* gradients are all-reduced by the
``GradReducer`` — FSDP2 leaves ignored parameters unsynchronised), the rank-0 broadcast and
same-model check, composition with semi-auto (:mod:`.spmd`) and pipeline stages (``root``), and
clear errors.

The levels, as MindSpore defines them:

* ``level1`` — optimizer state and master weights sharded (ZeRO-1): the optimizer updates
  ``Shard(0)`` slices, while every rank keeps the whole weights for forward and backward. On a
  plain data-parallel model over gloo this runs without FSDP2 (:mod:`.whole_weights`):
  gradients are reduced in DDP's buckets during backward (each rank's rows summed on it alone),
  and the updated slices are all-gathered once, in buckets, before the next forward. On NCCL or
  HCCL, and under pipeline stages, semi-auto sharding, expert shards, placed modules,
  ``param_dtype`` or deferred initialization, level1 runs on FSDP2 units whose weights are
  gathered once per step (prefetched unit by unit) and kept for backward, and whose gradients
  are reduce-scattered. Gradients of a gradient-accumulation step are accumulated whole on each rank
  (:meth:`no_sync` skips the reduction) and reduced once at its last micro-batch.
* ``level2`` — gradients sharded too: every micro-batch's gradients are reduce-scattered at once
  and only the rank's slice is accumulated (less memory, a collective per micro-batch).
* ``level3`` — weights sharded between uses as well: gathered before a unit's forward, freed
  after it and gathered again for its backward (ZeRO-3). On a plain data-parallel model over
  gloo it runs without FSDP2 too (:mod:`.resharded`: each weight gathered in place into its own
  storage, released between uses); elsewhere on FSDP2 units, whose side streams hide its copies
  on an accelerator.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from foundation.model_view import ModelView
from foundation.validate import check_clip_args
from hetero.placement.hooks import HookPlacedModule
from parallel.comm import get_rank
from parallel.config import OPTIMIZER_LEVELS, ParallelConfig
from parallel.context_parallel.wrapper import ContextParallel
from parallel.data.grad_reducer import GradReducer
from parallel.data.replicas import check_same_model, sync_from_rank0
from parallel.errors import collective_guard
from parallel.grad_clip import clip_grad_norm_
from parallel.mesh import optimizer_mesh
from parallel.optimizer_parallel.backends import Facts, choose, unbuilt
from parallel.optimizer_parallel.chunkwise import chunkwise, use_chunkwise
from parallel.optimizer_parallel.experts import ExpertShards, expert_reduction_rules, kept_whole
from parallel.optimizer_parallel.fsdp_units import (
    fully_shard_units,
    materialize_shards,
    reduction_rules,
)
from parallel.optimizer_parallel.low_precision import (
    attach_fp32,
    cast_keeping_fp32,
    fp32_keeper,
)
from parallel.optimizer_parallel.placed import placed_units
from parallel.optimizer_parallel.resharded import ReshardedWeights, can_release
from parallel.optimizer_parallel.spmd import average_over_context
from parallel.optimizer_parallel.units import (
    replicated_params,
    row_sharded_params,
    shared_params,
    unit_modules,
)
from parallel.optimizer_parallel.unshardable import mark_sharded
from parallel.optimizer_parallel.vocab_table import shard_tied_tables
from parallel.optimizer_parallel.whole_weights import WholeWeights
from parallel.weights.deferred_init import pending, refuse_meta

if TYPE_CHECKING:  # torch 2.13's (FSDP2's SPMD mode): foundation.compat.fsdp_mesh_dims
    from torch.distributed.fsdp import DataParallelMeshDims


def shard_mesh(shard_size: int | None, group_size: int) -> DeviceMesh:
    """The mesh the optimizer shards over, for data parallel on the whole world: 1-D
    ``("dp_shard",)``, or 2-D ``("dp_replicate", "dp_shard")`` when ``shard_size`` ranks share a
    shard and the groups replicate."""
    return optimizer_mesh(ParallelConfig(enable_parallel_optimizer=True, data_degree=group_size,
                                         optimizer_weight_shard_size=shard_size))


def _check(module: nn.Module, level: str, param_dtype: torch.dtype | None) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"ShardedDataParallel wraps an nn.Module, got {type(module).__name__}")
    if isinstance(module, (ModelView, FSDPModule)):
        raise ValueError(f"ShardedDataParallel: the model is already wrapped "
                         f"({type(module).__name__}); shard the plain model, or one placed by "
                         f"whole modules (hetero.place(model, mode='hooks'))")
    if level not in OPTIMIZER_LEVELS:
        raise ValueError(f"ShardedDataParallel: level {level!r} is not one of {OPTIMIZER_LEVELS}")
    if param_dtype not in (None, torch.float16, torch.bfloat16):
        raise ValueError(f"ShardedDataParallel: param_dtype must be torch.float16, "
                         f"torch.bfloat16 or None, got {param_dtype}")


def _shard_mesh(mesh: DeviceMesh | None, shard_size: int | None, size: int,
                group: dist.ProcessGroup | None) -> DeviceMesh:
    """The given shard mesh (checked against the group), or one over the whole world."""
    if size < 2:
        raise ValueError("ShardedDataParallel: the data-parallel group has 1 rank, so there is "
                         "no replica to share the optimizer with")
    if mesh is not None:
        if mesh.size() != size:
            raise ValueError(f"ShardedDataParallel: the shard mesh has {mesh.size()} ranks but "
                             f"the data-parallel group {size}; they must be the same ranks")
        return mesh
    if group is not None and size != dist.get_world_size():
        raise ValueError("ShardedDataParallel: give the shard mesh of a sub-group "
                         "(parallel.parallelize with a ParallelConfig does)")
    if shard_size is not None and (shard_size < 2 or size % shard_size):
        raise ValueError(f"ShardedDataParallel: shard_size={shard_size} must be at least 2 and "
                         f"divide the {size} data-parallel ranks")
    return shard_mesh(shard_size, size)


def _check_spmd(spmd: DataParallelMeshDims | None, mesh: DeviceMesh | None,
                context_group: dist.ProcessGroup | None) -> None:
    """ValueError where a semi-auto model's settings are incomplete."""
    if spmd is not None and mesh is None:
        raise ValueError("ShardedDataParallel(spmd=...): give the semi-auto mesh")
    if context_group is not None and spmd is None:
        raise ValueError("ShardedDataParallel(context_group=...) averages a semi-auto model's "
                         "gradients over its context ranks: give spmd too (without strategies "
                         "the context ranks are replicas in the shard mesh)")


def _check_offload(level: str) -> None:
    """ValueError where ``offload_params=True`` cannot run: level1 (whole weights)."""
    if level == "level1":
        raise ValueError("ShardedDataParallel(offload_params=True) rests each rank's shards of "
                         "the weights on its host, which level2/3 shard; level1 keeps whole "
                         "weights (hetero.offload.ParamOffload offloads those)")


def _request(spmd: DataParallelMeshDims | None, experts: ExpertShards | None, root: object,
             param_dtype: torch.dtype | None, deferred: bool, placed: bool,
             host_params: bool) -> set[str]:
    """The optimizer-parallel features (:data:`.backends.FEATURES`) these inputs bring."""
    return {name for name, on in (("semi_auto", spmd is not None),
                                  ("experts", experts is not None),
                                  ("pipeline", root is not None),
                                  ("param_dtype", param_dtype is not None),
                                  ("deferred", deferred), ("placed", placed),
                                  ("host_params", host_params)) if on}


class ShardedDataParallel(ModelView):
    """Data parallel over ``group`` with the optimizer sharded per ``level`` (module docstring).

    Build the optimizer after wrapping, on ``model.parameters()``: the sharded parameters are
    ``Shard(0)`` DTensors, so its state is per-rank slices.

    Args:
        level: ``"level1"``, ``"level2"`` or ``"level3"``.
        mesh: the shard mesh — 1-D over the group, or 2-D (replicate, shard); default: the whole
            group, or ``shard_size`` ranks per shard.
        shard_size: ranks sharing one shard when ``mesh`` is not given (None: all).
        threshold_kb: parameters under this many KB stay replicated.
        param_dtype: hold the parameters in this 16-bit dtype (sharded ones gathered in it);
            each keeps its FP32 values for ``hetero.optim.OffloadAdamW`` to seed its masters
            from (ZeRO-Offload: FP32 masters and moments of the rank's slice on the host).
        group: the data-parallel process group (default: the world).
        root: the module whose forward starts a step, made FSDP2's root (default: ``module``);
            a pipeline stage passes the ``StageRunner`` around it, so torch's schedules find
            the FSDP module and reduce-scatter once per step. A list gives one root per
            pipeline stage a rank holds (``interleaved_1f1b``, ``zbv``): each stage is its own
            FSDP2 root, which torch's multi-stage runtime gathers, reshards and reduces per
            stage; a parameter reachable from two roots (``zbv``'s tied embedding and head on
            one rank) stays replicated, since FSDP2 lets one root own a parameter.
        spmd: for a semi-auto model (``parallel.optimizer_parallel.spmd.semi_auto_dims``): its
            parameters are DTensors on ``mesh`` (the semi-auto mesh) and ``spmd`` names the
            data-parallel dims to shard (and replicate) over; their gradients are partial sums,
            and the replicated ones are reduced by semi-auto's own hooks.
        experts: an expert-parallel model's experts (``parallel.optimizer_parallel.experts``):
            sharded over their own ``dp`` mesh; ``group`` and ``mesh`` are then the
            ``dp × ep`` ranks that split the batch and replicate every other parameter.
        offload_params: level2/3 — each rank's shards of the weights and gradients rest in
            host memory and are gathered to the device a layer at a time (FSDP2's
            ``CPUOffloadPolicy``); the optimizer then steps them on the host.
        context_group: with ``spmd``, the ranks that run the same shards on the other parts
            of each sequence (a context split under strategies): every gradient, sharded or
            replicated, is also averaged over them (:func:`.spmd.average_over_context`).
    """

    def __init__(self, module: nn.Module, level: str = "level2", *,
                 mesh: DeviceMesh | None = None, shard_size: int | None = None,
                 threshold_kb: int = 64, gradients_mean: bool = True,
                 parameter_broadcast: bool = True, bucket_cap_mb: float = 25,
                 param_dtype: torch.dtype | None = None,
                 group: dist.ProcessGroup | None = None,
                 root: nn.Module | Sequence[nn.Module] | None = None,
                 spmd: DataParallelMeshDims | None = None,
                 experts: ExpertShards | None = None, offload_params: bool = False,
                 context_group: dist.ProcessGroup | None = None) -> None:
        get_rank(group)  # raises "call parallel.init()" when there is no process group
        # a view that only changes what the forward sees (hook placement, the context split):
        # the model inside is sharded, and the forward runs through the view
        view, module = module, module.module if isinstance(
            module, (HookPlacedModule, ContextParallel)) else module
        placed = view if isinstance(view, HookPlacedModule) else None
        _check(module, level, param_dtype)
        refuse_meta(module, "ShardedDataParallel")
        deferred = pending(module)  # allocated and initialized after fully_shard, shards only
        _check_spmd(spmd, mesh, context_group)
        if offload_params:
            _check_offload(level)
        request = _request(spmd, experts, root, param_dtype, deferred, placed is not None,
                           offload_params)
        why = unbuilt(request)  # refused before any collective
        if why is not None:
            raise ValueError(f"ShardedDataParallel: {why}")
        units: list[tuple[nn.Module, DeviceMesh]] = []
        borrowed: list[nn.Parameter] = []
        if spmd is None:
            mesh = _shard_mesh(mesh, shard_size, dist.get_world_size(group), group)
            if placed is not None:  # its checks raise before anything changes
                units, borrowed = placed_units(placed, mesh)
            with collective_guard("ShardedDataParallel set-up (model check and parameter "
                                  "broadcast)", group):
                check_same_model(module, group)
                if not deferred:  # else equal on every rank by construction
                    sync_from_rank0(module, group, verify=not parameter_broadcast)
        roots = [module] if root is None else list(root) if isinstance(root, (list, tuple)) \
            else [root]
        tables: list[nn.Parameter] = []
        if level == "level3" and not request - {"deferred"} and mesh.ndim == 1:
            # a tied embedding/head table: row blocks the head gathers, never the root's
            tables = shard_tied_tables(module, mesh, mean=gradients_mean,  # vocab_table.py
                                       min_bytes=threshold_kb * 1024)
        replicated, sparse = replicated_params(module, threshold_kb, shared_params(roots))
        replicated += [p for p in borrowed if all(p is not q for q in replicated)]
        # a 0-dim parameter has no rows to split (and FSDP2 refuses it): replicated
        replicated += [p for p in module.parameters()
                       if p.dim() == 0 and all(p is not q for q in replicated)]
        whole_experts = kept_whole(experts, replicated) if experts is not None else []
        expert_ids = experts.param_ids() if experts is not None else set()
        replicated = [p for p in replicated if id(p) not in expert_ids]
        ignored = {*replicated, *whole_experts, *row_sharded_params(module)}
        skip = {id(p) for p in ignored}
        cap = int(bucket_cap_mb * 2**20)
        # level1/2 on a plain data-parallel model: whole weights, no FSDP2 (whole_weights.py);
        # level3 too where gathers run chunkwise (gloo: FSDP2's copies would be exposed) and
        # each weight owns the storage it releases between uses (resharded.py)
        # the backend (backends.py): whole weights for level1/2 on a plain model, level3 in
        # place where gathers run chunkwise (gloo) and each weight owns its storage, else FSDP2
        backend = choose(level, request, Facts(
            gathers_chunkwise=lambda: all(chunkwise(g, mesh.device_type)
                                          for g in mesh.get_all_groups()),
            weights_releasable=lambda: can_release(p for p in module.parameters()
                                                   if id(p) not in skip)))
        whole = backend.name in ("whole_weights", "resharded")
        seeds = {}
        if param_dtype is not None:
            sharded = {n for n, p in module.named_parameters() if id(p) not in skip}
            seeds = cast_keeping_fp32(module, param_dtype, sharded, mesh.get_local_rank(-1),
                                      mesh.shape[-1])
        whole_weights, sliced = None, []
        if whole:
            # their own buckets, in a reused scratch; only the rows kept (every level)
            sliced = [p for p in module.parameters() if id(p) not in skip]
            whole_weights = (ReshardedWeights(module, sliced, mesh, unit_modules(module))
                             if level == "level3" else WholeWeights(module, sliced, mesh, level))
            fsdp_roots = []
        else:
            fsdp_roots = fully_shard_units(module, roots, mesh, level, ignored, spmd, experts,
                                           units, host_params=offload_params)
        # parameters keep their objects; 16-bit ones keep their generated FP32 blocks
        materialize_shards(module, fsdp_roots, fp32_keeper(module, param_dtype, seeds)
                     if deferred and param_dtype is not None else None,
                     ignored if offload_params else None, mesh)
        attach_fp32(module, seeds)
        for fsdp_root in fsdp_roots:
            reduction_rules(fsdp_root, mesh, spmd, skip,
                             sums=spmd is not None or not gradients_mean)
            use_chunkwise(fsdp_root, mesh)
            if context_group is not None:
                average_over_context(fsdp_root, context_group)
        if experts is not None:
            expert_reduction_rules(experts)
        super().__init__(view)  # a placed model's view stays the model: its plan, its hooks
        # not submodules: the registries are shared
        object.__setattr__(self, "_roots", fsdp_roots)
        object.__setattr__(self, "_whole", whole_weights)
        #: every rank holds the whole weights between steps (level1/2 without FSDP2), not 1/N
        self.keeps_whole_weights = whole_weights is not None and level != "level3"
        self.level = level
        self.mesh = mesh
        self.group = group
        self.gradients_mean = gradients_mean
        #: (ep, dp) of an expert-parallel model's experts, else None
        self.expert_dims = (experts.ep, experts.mesh.size()) if experts is not None else None
        #: context ranks every gradient is also averaged over (1: no sequence split)
        self.context_ranks = dist.get_world_size(context_group) if context_group else 1
        #: ranks one parameter's optimizer state is spread over (the shard dims' product)
        self.shard_ranks = (mesh.shape[-1] if spmd is None else
                            math.prod(mesh[n].size() for n in spmd.shard_names))
        mark_sharded([p for p in module.parameters()
                      if isinstance(p, DTensor) and id(p) not in skip] + tables)
        kept = {id(p) for p in (*replicated, *whole_experts)}
        self.replicated = [n for n, p in module.named_parameters() if id(p) in kept]
        # on a 1-D mesh each rank's rows are reduced on it alone (a reduce-scatter); with
        # replicas (2-D) the rows are all-reduced over every rank holding them
        slices = GradReducer(sliced, mean=gradients_mean, cap_bytes=cap, group=group,
                             keep=whole_weights.keep_rows,
                             reduce_bucket=whole_weights.scatter_bucket if mesh.ndim == 1
                             else None) if sliced else None
        self._reducers = [r for r in (
            GradReducer(replicated, mean=gradients_mean, cap_bytes=cap, group=group,
                        sparse_params=sparse) if replicated and spmd is None else None,
            # semi-auto reduced these over its data dims already; the context ranks' average
            GradReducer(replicated, mean=True, cap_bytes=cap, group=context_group)
            if replicated and context_group is not None else None,
            slices,
            # experts FSDP2 leaves whole: all-reduced over the dp ranks holding the same shard
            GradReducer(whole_experts, mean=gradients_mean, cap_bytes=cap,
                        group=experts.group)
            if whole_experts and experts is not None and experts.group is not None else None,
        ) if r is not None]
        if slices is not None:  # the rows its reducer kept become the slices' gradients
            slices.on_reduced = lambda: whole_weights.leave(rows=slices.kept)
        #: reduced at every micro-batch, under no_sync too (level2/3's slices: level1
        #: accumulates whole gradients and reduces them once)
        self._every_micro_batch = [slices] if slices is not None and level != "level1" else []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._model(*args, **kwargs)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip all gradients, sharded and replicated, by their global norm (returned)."""
        check_clip_args("ShardedDataParallel.clip_grad_norm_", max_norm, norm_type)
        return clip_grad_norm_(self.parameters(), max_norm, norm_type, error_if_nonfinite)

    def sync_gradients(self) -> None:
        """All-reduce the replicated parameters' gradients accumulated under :meth:`no_sync`
        (a pipeline schedule's micro-batches; the sharded ones are reduce-scattered by the
        schedule itself)."""
        for reducer in self._reducers:
            reducer.reduce_accumulated()

    def explain(self) -> str:
        """One line per kind of parameter: how many are sharded over how many ranks, and which
        stay replicated."""
        shape = " × ".join(f"{n}={s}" for n, s in zip(self.mesh.mesh_dim_names or (),
                                                      self.mesh.shape, strict=True))
        names = dict(self._model.named_parameters())
        kept = set(self.replicated)
        sharded = sum(p.numel() for n, p in names.items() if n not in kept and
                      isinstance(p, DTensor))
        replicated = sum(names[n].numel() for n in self.replicated)
        return (f"optimizer parallel {self.level} over {shape}: {sharded:,} parameter elements "
                f"sharded (optimizer state 1/{self.shard_ranks} per rank), {replicated:,} "
                f"replicated in {len(self.replicated)} tensors"
                + (f" ({', '.join(self.replicated[:4])}{', ...' if len(kept) > 4 else ''})"
                   if kept else "")
                + (f"; every gradient then averaged over the {self.context_ranks} context "
                   f"ranks holding the same shards" if self.context_ranks > 1 else "")
                + (f"; MoE experts: ep={self.expert_dims[0]} shards, each over its "
                   f"{self.expert_dims[1]} replicas (dp × cp)" if self.expert_dims else ""))

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """The micro-batches of a gradient-accumulation step but the last: level1 accumulates
        whole gradients without communicating; level2/3 still reduce each micro-batch (their
        gradients are sharded: only the slice is kept). Replicated parameters accumulate
        locally at every level."""
        roots: list[FSDPModule] = self._roots
        if self.level == "level1":
            for fsdp in roots:
                fsdp.set_requires_gradient_sync(False)
        previous = [reducer.enabled for reducer in self._reducers]
        for reducer in self._reducers:
            reducer.enabled = reducer in self._every_micro_batch and reducer.enabled
        try:
            yield
        finally:
            if self.level == "level1":
                for fsdp in roots:
                    fsdp.set_requires_gradient_sync(True)
            for reducer, enabled in zip(self._reducers, previous, strict=True):
                reducer.enabled = enabled
