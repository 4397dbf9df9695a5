"""The FSDP2 side of ``ShardedDataParallel`` (:mod:`.sharded`): which modules become FSDP2
units and on which mesh, how their gradients reduce on each backend, and deferred init of the
shards this rank holds.

Why these rules: FSDP2 averages with ``AVG``/``PREMUL_SUM``, which only NCCL has, so on gloo and
HCCL the units are told to sum and FSDP2 divides afterwards; the last layer and the root are
never resharded after forward, since their backward follows at once (torchtitan's rule); and
with host-resident shards the shards are made on the host, not on the device first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard

from foundation import device as hd
from parallel.optimizer_parallel.experts import ExpertShards, shard_expert_units
from parallel.optimizer_parallel.spmd import reduce_as_partial_sums
from parallel.optimizer_parallel.units import unit_modules
from parallel.weights.deferred_init import materialize_pending

if TYPE_CHECKING:  # torch 2.13's (FSDP2's SPMD mode): foundation.compat.fsdp_mesh_dims
    from torch.distributed.fsdp import DataParallelMeshDims


def fully_shard_units(module: nn.Module, roots: list[nn.Module], mesh: DeviceMesh, level: str,
                      ignored: set[nn.Parameter], spmd: DataParallelMeshDims | None,
                      experts: ExpertShards | None, placed: list[tuple[nn.Module, DeviceMesh]],
                      host_params: bool = False) -> list[FSDPModule]:
    """FSDP2 on every unit (expert modules first, on their own mesh; then a placed model's
    boundary modules, each on its device's mesh: ``placed.py``), then on each of ``roots``;
    returns the root FSDP modules. ``host_params``: the units' shards rest in host memory
    (``CPUOffloadPolicy``, pinned where an accelerator copies from it)."""
    offload: dict[str, Any] = {"offload_policy": CPUOffloadPolicy(pin_memory=hd.can_pin())} \
        if host_params else {}
    if spmd is not None:  # torch 2.13's SPMD mode (older torch refused it in fsdp_mesh_dims)
        offload["dp_mesh_dims"] = spmd
    if experts is not None:
        shard_expert_units(experts, level, ignored)
    done = set()
    for unit, unit_mesh in placed:
        fsdp = fully_shard(unit, mesh=unit_mesh, reshard_after_forward=level == "level3",
                           ignored_params=ignored)
        if not mesh_averages(unit_mesh):  # the host twin's gloo: no AVG
            fsdp.set_force_sum_reduction_for_comms(True)
        done.add(id(unit))
    units = [unit for unit in unit_modules(module) if id(unit) not in done]
    for index, unit in enumerate(units):
        # the last layer's backward comes right after its forward (only the root's head and
        # the loss run between): resharding it would gather it again at once (torchtitan)
        fully_shard(unit, mesh=mesh,
                    reshard_after_forward=level == "level3" and index < len(units) - 1,
                    ignored_params=ignored, **offload)
    # the root's gather is needed again at once by backward: never resharded (torchtitan)
    return [fully_shard(root, mesh=mesh, reshard_after_forward=False, ignored_params=ignored,
                        **offload) for root in roots]


def materialize_shards(module: nn.Module, fsdp_roots: Sequence[nn.Module], keep: Any,
                       host_params: set[nn.Parameter] | None, mesh: DeviceMesh) -> None:
    """Deferred init of what this rank holds (nothing when ``module`` has values already).
    ``host_params``: the shards rest on the host, and these parameters (the ones FSDP2 leaves)
    compute on the device. The shards are then made on the host (torchtitan's
    ``to_empty("cpu")`` under CPU offload: made on the accelerator, every shard of a root would
    be there at once before FSDP2 copied it home), and those parameters and the buffers go to
    the device, as FSDP2 moves what it manages when the model has values."""
    materialize_pending(module, roots=fsdp_roots, keep=keep,
                        device=None if host_params is None else hd.resolve("cpu"))
    if host_params is not None:
        to_mesh_device([*host_params, *module.buffers()], mesh)


def to_mesh_device(tensors: Iterable[torch.Tensor], mesh: DeviceMesh) -> None:
    """Move ``tensors`` (the parameters FSDP2 ignores) to ``mesh``'s device, keeping each
    object, as FSDP2 moves the states it manages (a model with weights on the host is built
    there)."""
    device = hd.resolve("device") if mesh.device_type == hd.resolve("device").type \
        else torch.device(mesh.device_type)
    for tensor in tensors:
        if tensor.device != device and not tensor.is_meta:
            tensor.data = tensor.data.to(device)


def mesh_averages(mesh: DeviceMesh) -> bool:
    """Whether every group of ``mesh`` reduces its device's tensors with a backend that has
    ``AVG`` and ``PREMUL_SUM`` (NCCL; not HCCL nor gloo: see the device layer)."""
    device = torch.device(mesh.device_type)
    return all(hd.supports_average_reductions(hd.group_backend(group, device))
               for group in mesh.get_all_groups())


def reduction_rules(root: nn.Module, mesh: DeviceMesh, spmd: DataParallelMeshDims | None,
                     skip: set[int], sums: bool) -> None:
    """How the FSDP units under ``root`` reduce: semi-auto's whole-batch gradients as shares;
    sums (``sums``: semi-auto's gradients are partial sums of the global-mean loss already, or
    ``gradients_mean=False``) as a forced SUM with a divide factor of 1; means as FSDP2's AVG
    only where the backend has it (NCCL), else as a forced SUM that FSDP2 divides by the
    data-parallel size afterwards (HCCL has no AVG or PREMUL_SUM, gloo no PREMUL_SUM)."""
    if spmd is not None:
        names = mesh.mesh_dim_names or ()
        dp = tuple(names.index(n) for n in (*spmd.replicate_names, *spmd.shard_names))
        reduce_as_partial_sums(root, dp, skip)
    force_sum = sums or not mesh_averages(mesh)
    for unit in root.modules():  # both setters act on one FSDP module, not its tree
        if isinstance(unit, FSDPModule) and force_sum:
            if sums:
                unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
