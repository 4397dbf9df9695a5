"""Hetero placement tags under semi-auto parallel: tagged modules compute on the host, sharded.

``hetero.set_device(module, "cpu")`` on a model that ``parallelize_semi_auto`` shards puts that
module's parameters, buffers and computation on the host of every rank, and the rest on the
device, with every strategy applied on both sides.

**The order: placement first (by whole modules), sharding second, each parameter on the mesh of
its home.** Placement decides where each module runs from its tags alone (innermost tag wins;
a tensor shared by modules on both sides lives where an explicit tag puts it:
``hetero.placement.assign.module_placement``, the rules of ``hetero.place(mode="hooks")``). Then
sharding lays every parameter out by its strategy — or replicated — as always, but on the mesh of
its home: the semi-auto device mesh, or its *host twin*: the same ranks, shape, dimension names
and process groups with device type ``"cpu"`` (the job's ``"cpu:gloo,<device>:<backend>"``
groups carry host tensors over gloo). Both halves are DTensor code, so the redistributions,
the gradient reductions and an offloading optimizer work alike on either mesh.

Why not the other orders:

* graph placement first (``hetero.place``, then sharding): the placed model runs a captured
  graph of the whole model, so semi-auto's module hooks (layouts at tagged modules) never run;
  placing an already sharded model would have to capture DTensor code with ``torch.export``.
  ``parallelize`` refuses a ``hetero.place``'d model in semi-auto mode and asks for the tagged
  one. Placement here is by whole modules, as in hooks mode: ops in a parent's ``forward``
  stay with the parent, and op or scope tags (``set_device(op)``, ``device_scope``), which only
  a captured graph records, do not move anything.
* sharding the device part only, the host modules left plain: a host module would then compute
  on full, gathered activations on every rank, and under the dataset strategy (each rank feeds
  its slice) its gradients would need a reduction of their own. On the twin mesh it is sharded
  like the rest.

**A tagged module that carries a strategy** is host tensor parallel: its slices live in the
hosts' memories and its collectives run over gloo. That is meaningful — host memory and host
compute per rank fall with the slices, which is why a table is put on the host to begin with
(as the parameter server shards rows over the hosts) — so it is kept, not refused.

At a module whose device differs from its parent's, a forward pre-hook (run before semi-auto's
own) moves its inputs onto its mesh and a forward hook (run after semi-auto's) moves its outputs
back to the parent's: a DTensor keeps its placements and only its local shard is copied
(``to_local`` → copy → ``from_local``, all differentiable, so gradients take the reverse route).
A parameter homed on one side and registered in a module on the other (a tied output head) is
lent to that module for its forward as such a moved copy, so both uses' gradients sum into the
one parameter, as hooks-mode placement does.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import foundation.device as hd
from foundation.compat import pytree
from foundation.lend import LendDuringForward
from hetero.placement.assign import module_placement
from hetero.placement.hooks import HookPlacedModule
from hetero.placement.placed import PlacedModule
from hetero.placement.transfer import to_device

HOST = "cpu"


@dataclasses.dataclass(frozen=True)
class HostPlacement:
    """Where each module runs and each parameter/buffer lives ("cpu" or "device")."""

    devices: dict[str, str]  # module path -> logical device
    homes: dict[str, str]    # parameter/buffer name (every alias) -> logical device

    @property
    def any_host(self) -> bool:
        return HOST in self.devices.values() or HOST in self.homes.values()

    def boundaries(self) -> list[str]:
        """Module paths whose device differs from their parent's (the root counts when it is
        placed on the host)."""
        return [path for path, dev in self.devices.items()
                if dev != self.devices.get(path.rpartition(".")[0] if path else None,
                                           "device")]


def host_placement(model: nn.Module) -> HostPlacement:
    """The placement ``model``'s ``set_device`` tags ask for; refuses, before anything changes,
    a model already placed by ``hetero.place`` and a shared tensor tagged for both sides."""
    if isinstance(model, (PlacedModule, HookPlacedModule)):
        raise ValueError(f"semi-auto parallel got a hetero.place'd model "
                         f"({type(model).__name__}); under semi_auto_parallel/auto_parallel "
                         f"placement is by whole modules and done by the sharding itself: pass "
                         f"the tagged model (hetero.set_device on its modules) to "
                         f"parallel.parallelize instead of hetero.place's result")
    devices, homes = module_placement(model)
    return HostPlacement(devices, homes)


def host_twin(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh``'s ranks, shape and process groups as a mesh of host tensors (no new process
    group is made: DTensor collectives on host tensors go to the groups' gloo). Its dimension
    names end in ``@host``, so it never equals ``mesh``, not even where the device *is* the host
    (CPU-only): a DTensor that crossed a boundary without being moved fails loudly everywhere."""
    names = mesh.mesh_dim_names or tuple(f"dim{j}" for j in range(mesh.ndim))
    return DeviceMesh.from_group(mesh.get_all_groups(), hd.resolve(HOST).type,
                                 mesh=mesh.mesh, mesh_dim_names=tuple(f"{n}@host" for n in names))


def move_to_mesh(value: Any, mesh: DeviceMesh, device: torch.device) -> Any:
    """``value`` (any pytree) on ``mesh``: a DTensor elsewhere keeps its placements and only
    its local shard is copied to ``device``; a plain tensor is copied to ``device``. All of it
    differentiable."""
    def move(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, DTensor):
            return to_device(t, device)
        if t.device_mesh is mesh:
            return t
        return DTensor.from_local(to_device(t.to_local(), device), mesh, t.placements,
                                  shape=t.shape, stride=t.stride(), run_check=False)
    return pytree.tree_map_only(torch.Tensor, move, value)


def install_boundaries(model: nn.Module, placement: HostPlacement,
                       meshes: dict[str, DeviceMesh]) -> None:
    """The boundary and lending hooks of the module docstring; call after semi-auto's hooks
    are installed (the boundary's input move is put in front of them, its output move after)."""
    for path in placement.boundaries():
        module = model.get_submodule(path)
        inner = placement.devices[path]
        module.register_forward_pre_hook(
            lambda m, a, k, d=inner: move_to_mesh((a, k), meshes[d], hd.resolve(d)),
            with_kwargs=True, prepend=True)
        if path:  # the root's outputs stay where it computed them, as in one process
            outer = placement.devices[path.rpartition(".")[0]]
            module.register_forward_hook(
                lambda m, a, out, d=outer: move_to_mesh(out, meshes[d], hd.resolve(d)))
    for path, module in model.named_modules():
        dev = placement.devices[path]
        foreign = [name for name, _ in [*module.named_parameters(recurse=False),
                                        *module.named_buffers(recurse=False)]
                   if placement.homes[f"{path}.{name}" if path else name] != dev]
        if foreign:
            LendDuringForward(module, foreign, partial(move_to_mesh, mesh=meshes[dev],
                                                       device=hd.resolve(dev)))
