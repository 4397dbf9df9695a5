"""Optimizer parallel on a semi-auto model: shard each parameter's optimizer slice along the
data-parallel dims of the semi-auto mesh, keeping its operator-parallel sharding (2-D DTensor).

Semi-auto parameters are DTensors on one mesh whose outer dims carry the batch axis (the ``data``
ranks of a stage) and whose inner dims shard the operators. FSDP2's SPMD mode
(``fully_shard(..., dp_mesh_dims=...)``) shards such parameters further along named mesh dims, so
a weight ``(Replicate(), Shard(1))`` becomes ``(Shard(0), Shard(1))``: its optimizer state is
1/(dp × mp) per rank, and the gathered weight the operators see is exactly semi-auto's.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Partial

from foundation.compat import fsdp_mesh_dims
from parallel.semi_auto.apply import batch_mesh_dims, semi_auto_state

if TYPE_CHECKING:  # torch 2.13's (FSDP2's SPMD mode): foundation.compat.fsdp_mesh_dims
    from torch.distributed.fsdp import DataParallelMeshDims


def semi_auto_dims(model: nn.Module, data: int, shard_size: int | None
                   ) -> tuple[DeviceMesh, DataParallelMeshDims]:
    """The semi-auto mesh of ``model`` and the dims optimizer parallel uses: the outer dims
    whose sizes multiply to ``data``, the last of them (``shard_size`` ranks) sharded and the
    others replicated. ValueError naming the rule when the mesh does not fit (a parameter split
    along the batch dims was refused before sharding: ``replicated_on_batch``)."""
    state = semi_auto_state(model)
    if state is None:
        raise ValueError("optimizer parallel over a semi-auto model: the model is not "
                         "semi-auto parallelized")
    # the parameters' own mesh object: FSDP2 compares meshes by identity, and DTensor may hand
    # a parameter an equal mesh built earlier rather than the one semi-auto recorded
    mesh = next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)),
                state.mesh)
    names = mesh.mesh_dim_names
    shape = tuple(mesh.shape)
    dp = [j for j in batch_mesh_dims(shape, data) if shape[j] > 1]
    shard_size = shard_size or data
    split = next((i for i in range(len(dp) + 1)
                  if math.prod(shape[j] for j in dp[i:]) == shard_size), None)
    if split is None:
        raise ValueError(f"optimizer_weight_shard_size={shard_size}: the data-parallel dims "
                         f"{[shape[j] for j in dp]} of the semi-auto mesh {shape} have no "
                         f"inner block of that size")
    replicate = tuple(names[j] for j in dp[:split])
    shard = tuple(names[j] for j in dp[split:])
    return mesh, fsdp_mesh_dims(shard=shard or None, replicate=replicate or None)


def _as_partial_on_dp(param: torch.Tensor, dp: tuple[int, ...]) -> None:
    """A gradient computed redundantly on every data-parallel rank (``Replicate()`` there: its
    operator does not split the batch over that dim) becomes an equal share of itself
    (``Partial()``), so the reduce-scatter's sum gives it once, not ``dp`` times."""
    grad = param.grad
    if not isinstance(grad, DTensor):
        return
    dims = [j for j in dp if grad.placements[j].is_replicate()]
    if not dims:
        return
    share = math.prod(grad.device_mesh.size(j) for j in dims)
    placements = [Partial() if j in dims else p for j, p in enumerate(grad.placements)]
    param.grad = DTensor.from_local(grad.to_local() / share, grad.device_mesh, placements,
                                    shape=grad.shape, stride=grad.stride(), run_check=False)


def reduce_as_partial_sums(root: nn.Module, dp: tuple[int, ...], skip: set[int]) -> None:
    """FSDP2 (SPMD mode) reduce-scatters a gradient's ``Partial`` and ``Replicate`` dp dims
    alike with a sum; semi-auto gives ``Replicate`` where an operator keeps the whole batch on
    every dp rank. Hook the parameters FSDP2 hands each unit's forward (its gathered, unsharded
    ones: public ``parameters()`` after FSDP2's own pre-forward hook, which runs first) so such
    gradients are shares before FSDP2 reads them. ``skip``: ids of parameters FSDP2 ignores."""
    hooked: set[int] = set()

    def hook_gathered(module: nn.Module, args: tuple) -> None:
        for p in module.parameters():
            if id(p) not in hooked and id(p) not in skip and p.requires_grad:
                hooked.add(id(p))
                p.register_post_accumulate_grad_hook(lambda q: _as_partial_on_dp(q, dp))

    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.register_forward_pre_hook(hook_gathered)


def average_over_context(root: FSDPModule, group: dist.ProcessGroup) -> None:
    """Average every FSDP unit's reduced gradient shard under ``root`` over ``group``: the
    context ranks of a sequence split under strategies, which hold the same shards and computed
    them on other tokens (each rank's loss the mean over its own). FSDP2's all-reduce hook
    runs on each unit's reduce-scatter output, the flat shard its gradients then view, so the
    average is one collective per unit, after the data-parallel reduction and before any
    accumulation (torch has no option for a second reduction group in SPMD mode). A sum and a
    division, not ``AVG``: gloo and HCCL lack it."""
    size = dist.get_world_size(group)

    def average(shard: torch.Tensor) -> None:
        dist.all_reduce(shard, group=group)
        shard.div_(size)

    for unit in root.modules():  # the setter acts on one FSDP module, not its tree
        if isinstance(unit, FSDPModule):
            unit.set_all_reduce_hook(average)
