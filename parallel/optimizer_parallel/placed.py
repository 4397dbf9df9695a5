"""Optimizer parallel on a model placed by whole modules (``hetero.place(model, mode="hooks")``).

``parallel.parallelize`` places ``set_device``-tagged modules this way when the config enables
optimizer parallel: each module's parameters live on its device and hooks move activations at
the boundaries, while the modules' own ``forward`` still runs, so FSDP2's per-module hooks fire
(a captured graph, ``hetero.place``'s default, never calls them). FSDP2 keeps one unit's
parameters on its mesh's device and moves them there, so:

* every **placement boundary** (a module whose device differs from its parent's: the partitions
  of the placement plan) becomes its own FSDP2 unit, innermost first, on the mesh of its device:
  the job's shard mesh, or its host twin (``parallel.semi_auto.host.host_twin``: the same ranks
  and process groups, host tensors over their gloo). A layer of a stack that holds a boundary is
  then a unit of the rest, and the root unit holds what no unit took;
* a **borrowed** parameter (registered in a module on the other side of a boundary: a tied
  embedding and head) is lent to that module as a moved copy for its forward, which FSDP2's own
  parameter swap cannot share: it stays replicated and its gradient is all-reduced.

The root module must stay on the mesh's device (tag modules inside it, not the root itself).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hetero.placement.hooks import HookPlacedModule
from parallel.semi_auto.host import host_twin


def placed_units(view: HookPlacedModule, mesh: DeviceMesh
                 ) -> tuple[list[tuple[nn.Module, DeviceMesh]], list[nn.Parameter]]:
    """The boundary modules of ``view``'s placement (innermost first), each with the mesh its
    FSDP2 unit shards over, and the borrowed parameters (kept replicated). ValueError when the
    root itself is placed off the mesh's device; nothing is changed."""
    model = view.module
    modules = dict(model.named_modules())
    side = {path: part.device for part in view.plan for path in part.modules}  # "cpu"/"device"
    root = next(part.torch_device for part in view.plan if "" in part.modules)
    if root.type != mesh.device_type:
        raise ValueError(f"optimizer parallel on a placed model: the root "
                         f"{type(model).__name__} is placed on {root}, but the optimizer shards "
                         f"over {mesh.device_type} ranks; tag the modules to move (the rest "
                         f"stays on the device), not the root")
    homes = view.plan.tensor_home
    borrowed: dict[int, nn.Parameter] = {}
    for path, module in modules.items():
        for name, param in module.named_parameters(recurse=False):
            # logical names: on a host-only machine both sides are the CPU, but still two sides
            if homes[f"{path}.{name}" if path else name] != side[path]:
                borrowed[id(param)] = param
    twin: DeviceMesh | None = None
    units = []
    for part in sorted((p for p in view.plan if p.name != "<root>"),
                       key=lambda p: -p.name.count(".")):
        unit_mesh = mesh
        if torch.device(part.torch_device).type != mesh.device_type:
            twin = twin if twin is not None else host_twin(mesh)
            unit_mesh = twin
        units.append((modules[part.name], unit_mesh))
    return units, list(borrowed.values())
