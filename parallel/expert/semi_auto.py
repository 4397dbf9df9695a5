"""MoE layers inside a semi-auto model: the dense parts sharded by the strategies (DTensor), each
MoE layer run on plain local tensors with its experts sharded over ``ep``.

A semi-auto stage's ``data × expert × tensor`` ranks form one mesh whose outer dims carry the
batch axis (``dp × ep`` ranks, the strategies' ``dp``) and inner dims the operator split
(``tp``). Routing has data-dependent shapes that DTensor cannot follow, so the MoE layers are
left out of the DTensor conversion (detached while semi-auto converts the model) and run as
expert parallel does:

* the layer's input is redistributed to ``Shard(0)`` over the batch dims and ``Replicate()`` over
  the others, and each rank runs the layer on its own rows (its batch slice; the ``mp`` ranks of
  a slice run the same rows redundantly); the output comes back as a DTensor of the same
  placements;
* experts are ``Shard(0)`` DTensors over the ``ep`` ranks (as under data parallel), tokens reach
  them by all-to-all between the ``ep`` peers of one ``mp`` coordinate, and routing (capacity,
  load, the balancing loss) is agreed over the ``dp × ep`` ranks of that coordinate, so the
  layer computes what it would in one process on the global batch;
* ``aux_loss`` is a replicated DTensor (the model adds it to a DTensor loss); its gradient is
  split over the batch ranks, whose routing all-reduce sums it back;
* the semi-auto loss is the global batch's, so a rank's gradients are its share: the router's
  (and, with ``expert_degree=1``, the experts') are summed over the batch ranks of its ``mp``
  coordinate, each expert shard's over the ``dp`` ranks holding it, and none over ``mp`` (its
  ranks compute the same values).

Every check comes before the model changes; semi-auto's own checks run while the layers are
detached, and the layers are put back if it refuses.

A meta-device model (deferred initialization) takes no broadcast: the experts are cut to the
rank's meta ``Shard(0)``, then each MoE layer alone gets storage (``to_empty``: the rank's
experts and the router whole, before any gradient hook is registered on them), and every value
is filled after the last step, as the dense blocks are (``parallel.weights.deferred_spmd``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from foundation.collective_check import check as check_collective
from parallel.config import ParallelConfig
from parallel.data.grad_reducer import GradReducer
from parallel.errors import collective_guard
from parallel.expert.experts import check_expert_layers, scale_gradients, shard_expert_weights
from parallel.mesh import batch_mesh, parallel_mesh
from parallel.nn.exchange import ExpertGroups
from parallel.nn.moe import MoE
from parallel.semi_auto.apply import batch_mesh_dims, semi_auto_state
from parallel.semi_auto.shard import module_tag
from parallel.weights.deferred_init import pending


class _Vacant(nn.Module):
    """Holds an MoE layer's place (its input passes through) while semi-auto converts the
    model, so semi-auto neither converts the layer's parameters nor hooks its modules."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


@contextmanager
def _detached(model: nn.Module, layers: list[tuple[str, MoE]]) -> Iterator[None]:
    """The MoE layers replaced by placeholders inside; put back afterwards, also on error."""
    parents = dict(model.named_modules())
    slots = []
    for path, moe in layers:
        parent, _, name = path.rpartition(".")
        slots.append((parents[parent], name, moe))
        setattr(parents[parent], name, _Vacant())
    try:
        yield
    finally:
        for parent, name, moe in slots:
            setattr(parent, name, moe)


def _check(config: ParallelConfig, layers: list[tuple[str, MoE]]) -> None:
    if config.pipeline_degree > 1 or config.enable_parallel_optimizer or config.multi_copy > 1:
        raise ValueError("MoE layers in a semi_auto_parallel model with pipeline stages, "
                         "optimizer parallel or multi_copy are not built yet")
    for path, moe in layers:
        inner = [f"{path}.{p}" if p else path for p, _ in moe.named_modules()]
        for pattern in config.strategies:
            hit = next((p for p in inner if fnmatch.fnmatchcase(p, pattern)), None)
            if hit is not None:
                raise ValueError(f"strategy pattern {pattern!r} names {hit!r}, part of the MoE "
                                 f"layer {path!r}: MoE layers are not sharded by strategies "
                                 f"(their experts are split over the expert ranks); give "
                                 f"strategies to the dense modules only")
        tagged = next((p for p, m in moe.named_modules() if module_tag(m) is not None), None)
        if tagged is not None:
            raise ValueError(f"module {path}.{tagged} inside the MoE layer {path!r} carries a "
                             f"parallel.shard tag: MoE layers are not sharded by strategies")


def _semi_auto_mesh(model: nn.Module) -> DeviceMesh:
    """The mesh the converted parameters live on (the object DTensor compares by identity)."""
    state = semi_auto_state(model)
    return next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)),
                state.mesh)


def _broadcast_from_rank0(layers: list[tuple[str, MoE]]) -> None:
    """Every rank of the job takes rank 0's MoE weights (semi-auto's ``distribute_tensor`` does
    the same for the dense parameters)."""
    with torch.no_grad():
        for _, moe in layers:
            for tensor in [*moe.parameters(), *moe.buffers()]:
                check_collective("broadcast", tensor.data, what="MoE broadcast", params=(0,))
                dist.broadcast(tensor.data, src=0)


def _summed_over(params: list[nn.Parameter], group: dist.ProcessGroup | None,
                 size: int) -> GradReducer | None:
    """Gradients summed over ``group``: each local gradient multiplied by ``size`` as it is
    computed, then averaged (an average of the already-reduced part is that part again, so
    accumulating micro-batches without ``no_sync`` stays right)."""
    if not params or group is None or size == 1:
        return None
    for p in params:
        p.register_hook(lambda grad, size=size: grad * size)
    return GradReducer(params, mean=True, cap_bytes=25 * 2**20, group=group)


class _LocalIsland:
    """The forward hooks that run one MoE layer on local rows of a semi-auto model."""

    def __init__(self, mesh: DeviceMesh, rows: list[Placement], batch_ranks: int) -> None:
        self.mesh, self.rows, self.batch_ranks = mesh, rows, batch_ranks
        self.reducers: list[GradReducer] = []

    def before(self, module: MoE, args: tuple) -> tuple:
        x = args[0]
        if not isinstance(x, DTensor):
            raise TypeError(f"MoE layer in a semi-auto model got a {type(x).__name__}; its "
                            f"input must come from the model's DTensor layers")
        if x.shape[0] % self.batch_ranks:
            raise ValueError(f"MoE layer in a semi-auto model: the batch of {x.shape[0]} must "
                             f"split evenly over the {self.batch_ranks} data × expert ranks")
        return (x.redistribute(self.mesh, self.rows).to_local(), *args[1:])

    def after(self, module: MoE, args: tuple, out: torch.Tensor) -> DTensor:
        aux = module.aux_loss
        if aux.requires_grad and self.batch_ranks > 1:  # value kept, gradient split
            aux = aux.detach() + (aux - aux.detach()) / self.batch_ranks
        module.aux_loss = DTensor.from_local(aux, self.mesh, [Replicate()] * self.mesh.ndim,
                                             run_check=False)
        return DTensor.from_local(out, self.mesh, self.rows, run_check=False)


def _islands(model: nn.Module, layers: list[tuple[str, MoE]], config: ParallelConfig,
             deferred: bool) -> None:
    """Expert parallel on the put-back MoE layers of a semi-auto ``model`` (module docstring);
    ``deferred``: the layers are on the meta device."""
    mesh = _semi_auto_mesh(model)
    dims = batch_mesh_dims(tuple(mesh.shape), config.batch_ranks)
    rows: list[Placement] = [Shard(0) if j in dims else Replicate() for j in range(mesh.ndim)]
    jobs = parallel_mesh(config)
    ep_mesh, batch = jobs["ep"], batch_mesh(config)
    batch_group = batch.get_group()
    dp_group = jobs["dp"].get_group() if config.data_degree > 1 else None
    groups = ExpertGroups(ep=ep_mesh.get_group(), ep_size=config.expert_degree,
                          ep_rank=ep_mesh.get_local_rank(), batch=batch_group,
                          batch_size=config.batch_ranks, batch_rank=batch.get_local_rank())
    with collective_guard("expert parallel set-up in a semi-auto model (MoE broadcast)"):
        if not deferred:  # deferred initialization: equal on every rank by construction
            _broadcast_from_rank0(layers)
        for _, moe in layers:
            if config.expert_degree > 1:  # each shard's gradient summed over its dp replicas
                shard_expert_weights(moe, ep_mesh, batch_group, float(config.data_degree),
                                     deferred=deferred)
            moe.groups = groups
    if deferred:  # the rank's experts only; filled with the rest after the last step
        for _, moe in layers:
            moe.to_empty(device=mesh.device_type)
            if config.expert_degree > 1:
                scale_gradients(moe, float(config.data_degree))
    island = _LocalIsland(mesh, rows, config.batch_ranks)
    experts = [p for _, moe in layers for p in moe.experts.parameters()]
    others = [p for _, moe in layers for p in moe.parameters() if not isinstance(p, DTensor)]
    island.reducers = [r for r in (
        _summed_over(others, batch_group, config.batch_ranks),
        GradReducer(experts, mean=True, cap_bytes=25 * 2**20, group=dp_group)
        if config.expert_degree > 1 and dp_group is not None else None) if r is not None]
    for _, moe in layers:
        moe.register_forward_pre_hook(island.before)
        moe.register_forward_hook(island.after)
        moe.semi_auto_island = island  # keeps the reducers alive with the layer


def parallelize_with_moe(model: nn.Module, config: ParallelConfig,
                         shard: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """``shard(model)`` (semi-auto) with the model's MoE layers left out and then made
    expert-parallel on local rows (module docstring); ``model`` when it has no MoE layer."""
    layers = check_expert_layers(model, config.expert_degree, require=config.expert_degree > 1)
    if not layers:
        return shard(model)
    _check(config, layers)
    deferred = pending(model)
    with _detached(model, layers):
        model = shard(model)
    _islands(model, layers, config, deferred)
    return model

