"""Optimizer parallel over an expert-parallel model: the experts' ``ep`` shards sharded again over
the ``dp × cp`` ranks that replicate each of them.

Expert parallel leaves every MoE layer's stacked experts as ``Shard(0)`` DTensors on the ``ep``
dimension of ``ParallelDims.expert_mesh()`` ``(pp, ep, tp, expert_replicas)``; the ``dp × cp``
ranks at one ``ep`` coordinate (its ``expert_replicas``) hold the same shard. The rest of the
model is replicated over all ``dp × ep × cp`` ranks holding tokens and is sharded there by the
caller. As torchtitan does for its MoE experts, each ``GroupedExperts`` module becomes its own
FSDP2 unit on the ``expert_replicas`` dimension of that mesh (the same root as ``ep``, so FSDP2
shards the ``ep`` shard along it: a 2-D ``(expert_replicas, ep)`` DTensor), before the layer and
root units take the rest.

Gradients: an expert's local gradient already sums the contributions of its ``ep`` peers'
tokens, so its reduce-scatter over ``dp × cp`` sums and divides by ``dp × cp × ep``
(``gradients_mean``: the mean over all ranks holding tokens, as every other parameter gets) or
by 1. Experts FSDP2 leaves alone (under the size threshold, or ``dp × cp = 1``: no replica to
shard over) keep their ``ep`` shard: their gradient is scaled by ``1 / ep`` as it is computed
and all-reduced (mean) over their replicas.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard


@dataclasses.dataclass(frozen=True)
class ExpertShards:
    """The expert modules of a model under optimizer parallel (module docstring).

    modules: the ``GroupedExperts`` of every MoE layer (their parameters are ``ep`` shards).
    mesh: the ``dp × cp`` ranks holding the same ``ep`` shards (``expert_replicas``).
    ep: the expert-parallel degree.
    gradients_mean: divide the reduced expert gradients by ``dp × cp × ep`` (else sum them).
    """

    modules: tuple[nn.Module, ...]
    mesh: DeviceMesh
    ep: int
    gradients_mean: bool

    def param_ids(self) -> set[int]:
        return {id(p) for m in self.modules for p in m.parameters()}

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The replicas' process group, or None when there is one (nothing to reduce)."""
        return self.mesh.get_group() if self.mesh.size() > 1 else None


def kept_whole(experts: ExpertShards, replicated: list[nn.Parameter]) -> list[nn.Parameter]:
    """The expert parameters FSDP2 must not shard: those under the size threshold
    (``replicated``), or all of them when ``dp × cp = 1``. Each gets the ``1 / ep`` gradient scale
    (``gradients_mean``) here."""
    ids = experts.param_ids()
    kept = ([p for m in experts.modules for p in m.parameters()] if experts.group is None
            else [p for p in replicated if id(p) in ids])
    if experts.gradients_mean and experts.ep > 1:
        for p in kept:
            p.register_hook(lambda grad, scale=1.0 / experts.ep: grad * scale)
    return kept


def shard_expert_units(experts: ExpertShards, level: str, ignored: set[nn.Parameter]) -> None:
    """Each expert module with a parameter to shard becomes an FSDP2 unit on the replicas' mesh
    (before its layer's unit claims it)."""
    if experts.group is None:
        return
    for module in experts.modules:
        if any(p not in ignored for p in module.parameters()):
            fully_shard(module, mesh=experts.mesh, reshard_after_forward=level == "level3",
                        ignored_params=ignored)


def expert_reduction_rules(experts: ExpertShards) -> None:
    """The expert units' reduce-scatter: a sum divided by ``dp × cp × ep`` (or not at all), as a
    forced SUM with a divide factor (gloo has no PREMUL_SUM)."""
    factor = float(experts.mesh.size() * experts.ep) if experts.gradients_mean else 1.0
    for module in experts.modules:
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(factor)
            module.set_force_sum_reduction_for_comms(True)

