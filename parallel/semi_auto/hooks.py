"""The hooks that make a parallelized model run: what torch's ``parallelize_module`` installs,
for semi-auto layouts.

* a tagged module's input is redistributed to its layout before ``forward`` (DTensor
  ``redistribute``), and its output placed by ``out_strategy`` after;
* plain tensors entering any other module become replicated DTensors (DTensor refuses to mix the
  two), e.g. positions made with ``torch.arange`` inside ``forward``; under the dataset strategy
  (``batch_dims``) the model's own inputs are this rank's slice of the batch, sharded on dim 0;
* the model's outputs come back as ordinary full tensors, so losses and metrics need no change
  (under the dataset strategy a batched output comes back as this rank's slice, as its input
  went in: a pipeline stage then sends the next stage the slice it expects);
* a parameter's gradient is reduced to the parameter's own placements once accumulated.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from foundation.compat import pytree
from parallel.errors import collective_guard
from parallel.semi_auto.execute import bring_to_layouts, place_output, to_dtensor
from parallel.semi_auto.shard import ModuleShard
from parallel.semi_auto.sharded_rows import fold_middle_splits
from parallel.semi_auto.strategy import OpPlan, check_shapes


@torch.no_grad()
def reduce_grad(param: torch.Tensor) -> None:
    """A replicated parameter used on sharded data gets ``Partial`` gradients: sum them over the
    ranks that shared the work (the reference's gradient AllReduce), once per backward."""
    grad = param.grad
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
        with collective_guard("semi-auto gradient all_reduce of a replicated parameter"):
            param.grad = grad.redistribute(param.device_mesh, param.placements)


#: root module -> (input hook, output hook): what a semi-auto model does at its own boundary, for
#: runners that execute the root's body themselves (``parallel.multi_copy``)
_ROOT_IO: weakref.WeakKeyDictionary[nn.Module, tuple[Callable, Callable]] = (
    weakref.WeakKeyDictionary())


def root_io(model: nn.Module) -> tuple[Callable, Callable] | None:
    """``(inputs(module, args, kwargs) -> (args, kwargs), outputs(module, args, out) -> out)``
    of a semi-auto root module, or None for a model semi-auto did not parallelize."""
    return _ROOT_IO.get(model)


def install_hooks(model: nn.Module, mesh: DeviceMesh,
                  modules: dict[str, tuple[nn.Module, ModuleShard, OpPlan]],
                  batch_dims: tuple[int, ...] = (),
                  module_meshes: dict[int, DeviceMesh] | None = None) -> None:
    """The forward hooks of the module docstring on ``model`` and all its modules; a module
    computes on ``module_meshes[id(module)]`` when given (host placement), else on ``mesh``
    (the root's)."""
    def replicate_on(on: DeviceMesh) -> Callable:
        def replicate_plain(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return pytree.tree_map_only(
                torch.Tensor, lambda t: to_dtensor(t, on, type(module).__name__), (args, kwargs))
        return replicate_plain
    replicate_plain = replicate_on(mesh)

    sharded = [Shard(0) if j in batch_dims else Replicate() for j in range(mesh.ndim)]

    def shard_batch(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return pytree.tree_map_only(torch.Tensor, lambda t: t if isinstance(t, DTensor) else (
            DTensor.from_local(t, mesh, sharded if t.dim() else [Replicate()] * mesh.ndim,
                               run_check=False)), (args, kwargs))

    tagged = {id(module): (tag, plan) for module, tag, plan in modules.values()}
    for module in model.modules():
        on = (module_meshes or {}).get(id(module), mesh)
        if id(module) in tagged:
            tag, plan = tagged[id(module)]
            module.register_forward_pre_hook(_tagged_pre_hook(on, tag, plan), with_kwargs=True)
            module.register_forward_hook(
                lambda m, a, out, tag=tag, plan=plan, on=on: place_output(plan, out, on,
                                                                          tag.record))
        elif module is model and batch_dims:
            module.register_forward_pre_hook(shard_batch, with_kwargs=True)
        else:
            module.register_forward_pre_hook(replicate_on(on), with_kwargs=True)
    def plain(t: DTensor) -> torch.Tensor:
        if batch_dims and t.dim():
            return t.redistribute(mesh, sharded).to_local()
        return t.full_tensor()
    def outputs(module: nn.Module, args: tuple, out: Any) -> Any:
        return pytree.tree_map_only(DTensor, plain, out)
    model.register_forward_hook(outputs)
    fold_middle_splits(model)
    if id(model) not in tagged:  # a tagged root is one operator: nothing inside to interleave
        _ROOT_IO[model] = (shard_batch if batch_dims else replicate_plain, outputs)


def _tagged_pre_hook(mesh: DeviceMesh, tag: ModuleShard, plan: OpPlan) -> Callable:
    """Check a tagged module's input against its layout and redistribute it there."""
    positions = tag.forward_inputs()

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        tensors: list[Any] = [None] * len(plan.inputs)
        for k, index in enumerate(positions):
            if k < len(args) and isinstance(args[k], torch.Tensor):
                tensors[index] = args[k]
        check_shapes(plan, tensors)
        moved = bring_to_layouts(plan, tensors, mesh, tag.record)
        new_args = list(args)
        for k, index in enumerate(positions):
            if moved[index] is not None:
                new_args[k] = moved[index]
        return tuple(new_args), kwargs
    return hook
