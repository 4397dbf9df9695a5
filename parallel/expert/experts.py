"""Expert parallel: every ``parallel.nn.MoE`` layer's experts sharded over the mesh's ``ep`` ranks.

``apply_expert_parallel(model, config)``, all checks before any change:

1. every MoE layer's ``num_experts`` must split evenly over ``expert`` ranks;
2. the ranks that split the batch (``dp × ep``) check they hold the same model and take rank 0's
   expert weights (the rest is broadcast by ``DataParallel``), then each keeps its ``E / ep``
   experts as ``Shard(0)`` DTensors on the ``ep`` mesh — so a distributed checkpoint saves the
   whole stacked tensor and loads under another ``ep``;
3. each MoE gets its :class:`~parallel.nn.exchange.ExpertGroups`: tokens go to their experts and
   back by all-to-all over ``ep``, routing statistics (capacity, load, the balancing loss) are
   agreed over every rank holding tokens, ``dp × ep × cp`` (also under plain data parallel,
   ``expert_degree=1``: an MoE model trains as it would in one process on the global batch;
   with a context split, choices beyond a capacity are dropped in rank order, each context
   rank's tokens being its chunks of the sequences);
4. ``ContextParallel`` over ``cp`` when the sequence is split, then ``DataParallel`` over
   ``dp × ep × cp`` averages the other parameters' gradients, and the experts' over ``dp × cp``
   (the replicas of a shard). An expert's local gradient already sums the contributions of its
   ``ep`` peers' tokens, so with ``gradients_mean`` it is also divided by ``ep``: the mean over
   all ``dp × ep × cp`` ranks, as for every other parameter.

Steps 1–3 are :func:`shard_experts`, which the combinations reuse: a pipeline stage's ranks
(``parallel.pipeline.build``; a stage may hold no MoE layer), optimizer parallel
(``parallel.optimizer_parallel.experts`` shards the rest over ``dp × ep × cp`` and each expert
shard over ``dp × cp`` instead of step 4); semi-auto mode (``parallel.expert.semi_auto``) reuses
step 2's cut of the experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from foundation.collective_check import check as check_collective
from parallel.config import ParallelConfig
from parallel.context_parallel import ContextParallel
from parallel.data.replicas import DataParallel, check_same_model
from parallel.dims import ParallelDims
from parallel.errors import collective_guard
from parallel.nn.exchange import ExpertGroups
from parallel.nn.moe import MoE
from parallel.weights.deferred_init import materialize_pending, pending


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    return [(path, m) for path, m in model.named_modules() if isinstance(m, MoE)]


def check_expert_layers(model: nn.Module, ep: int, *, require: bool = True
                        ) -> list[tuple[str, MoE]]:
    """``model``'s MoE layers, each checked to split its experts evenly over ``ep`` ranks and not
    to be sharded yet. ``require``: refuse a model without any (a pipeline stage may hold none;
    the whole model was checked before the split)."""
    layers = moe_layers(model)
    if not layers and require:
        raise ValueError(f"ParallelConfig.expert_degree={ep} shards the experts of parallel.nn.MoE "
                         f"layers, but the model has none")
    for path, moe in layers:
        if moe.num_experts % ep:
            raise ValueError(f"ParallelConfig.expert_degree={ep} must divide the experts of "
                             f"every MoE layer: '{path}' has num_experts={moe.num_experts}")
        if any(isinstance(p, DTensor) for p in moe.experts.parameters()):
            raise ValueError(f"MoE layer '{path}' is already expert-parallel")
    return layers


_EXPERT_WEIGHTS = ("w1", "w2")


def shard_expert_weights(moe: MoE, ep_mesh: DeviceMesh, batch: dist.ProcessGroup,
                         scale: float, *, deferred: bool = False) -> None:
    """``moe``'s stacked experts taken from the first rank of ``batch`` and cut to this rank's
    ``Shard(0)`` of them on ``ep_mesh``; each gradient multiplied by ``scale`` as computed.
    ``deferred``: the experts are on the meta device (deferred initialization): the cut is a
    meta shard, nothing is broadcast, and the caller adds the scale (:func:`scale_gradients`)
    once they are materialized."""
    ep_rank, ep = ep_mesh.get_local_rank(), ep_mesh.size()
    local = moe.num_experts // ep
    src = dist.get_global_rank(batch, 0)
    for name in _EXPERT_WEIGHTS:
        full = getattr(moe.experts, name)
        with torch.no_grad():
            if not deferred:
                check_collective("broadcast", full.data, batch, what=f"expert {name} broadcast",
                                 params=(src,))
                dist.broadcast(full.data, src=src, group=batch)
            mine = full.detach()[ep_rank * local:(ep_rank + 1) * local].clone()
        param = nn.Parameter(DTensor.from_local(mine, ep_mesh, [Shard(0)], run_check=False),
                             requires_grad=full.requires_grad)
        setattr(moe.experts, name, param)
    if not deferred:
        scale_gradients(moe, scale)


def scale_gradients(moe: MoE, scale: float) -> None:
    """Multiply each expert weight's gradient by ``scale`` as it is computed."""
    if scale != 1.0:
        for name in _EXPERT_WEIGHTS:
            getattr(moe.experts, name).register_hook(lambda grad: grad * scale)


def shard_experts(model: nn.Module, config: ParallelConfig, *, scale: float = 1.0,
                  require: bool = True, materialize: bool = True) -> list[tuple[str, MoE]]:
    """Steps 1–3 of the module docstring on ``model`` (a whole model, or a pipeline stage with
    ``require=False``): its MoE layers' experts sharded over ``ep`` (each expert gradient
    multiplied by ``scale`` as it is computed) and their routing agreed over ``dp × ep``.
    Returns the layers; the caller reduces the gradients (``DataParallel``, or optimizer
    parallel's shards). Needs ``parallel.init()`` and a resolved ``config``. A meta-device
    ``model`` (deferred initialization) is allocated and initialized once the experts are cut;
    ``materialize=False`` leaves that to the caller (optimizer parallel, after FSDP2 has
    sharded the rest, so the rank never holds the whole dense model)."""
    layers = check_expert_layers(model, config.expert_degree, require=require)
    dims = ParallelDims(config)
    # ep beside the ranks holding the same shards, in one mesh (FSDP2 shards over those)
    ep_mesh = dims.expert_mesh()["ep"]
    tokens = dims["replicas"]  # every rank holding tokens: dp × ep × cp
    batch_group = tokens.get_group()
    groups = ExpertGroups(ep=ep_mesh.get_group(), ep_size=config.expert_degree,
                          ep_rank=ep_mesh.get_local_rank(), batch=batch_group,
                          batch_size=tokens.size(), batch_rank=tokens.get_local_rank(),
                          ep_stride=config.context_degree)
    with collective_guard("expert parallel set-up (model check and expert broadcast)",
                          batch_group):
        check_same_model(model, batch_group)
        deferred = pending(model)
        for _, moe in layers:
            if config.expert_degree > 1:
                shard_expert_weights(moe, ep_mesh, batch_group, scale, deferred=deferred)
            moe.groups = groups
    if deferred:  # the experts cut to this rank's shards: allocate and initialize now (or the
        if materialize:  # caller does; hooks on meta parameters survive it: deferred_hooks)
            materialize_pending(model)
        for _, moe in layers:
            if config.expert_degree > 1:
                scale_gradients(moe, scale)
    return layers


def apply_expert_parallel(model: nn.Module, config: ParallelConfig, *,
                          require: bool = True) -> DataParallel:
    """``model`` with its MoE experts sharded over ``ep`` and wrapped in ``DataParallel`` (see
    the module docstring). Needs ``parallel.init()`` and a resolved ``config``. With
    ``expert_degree=1`` (plain data parallel of a model with MoE layers) nothing is sharded, but the
    layers still agree routing over the batch ranks, so they compute what one process would.
    ``require=False``: a pipeline stage, which may hold no MoE layer (then it is plain data
    parallel over the stage's ``dp × ep`` ranks)."""
    scale = 1.0 / config.expert_degree if config.gradients_mean else 1.0
    shard_experts(model, config, scale=scale, require=require)
    dims = ParallelDims(config)
    if dims.cp > 1:  # each rank runs its share of every sequence (routing agreed over all)
        model = ContextParallel(model, dims["cp"].get_group(),
                                method=config.context_method.value)
    whole = config.replica_ranks == dist.get_world_size()
    return DataParallel(model, gradients_mean=config.gradients_mean,
                        parameter_broadcast=config.parameter_broadcast,
                        group=None if whole else dims["replicas"].get_group(),
                        shard_group=dims["expert_replicas"].get_group()
                        if dims.dp * dims.cp > 1 else None)
