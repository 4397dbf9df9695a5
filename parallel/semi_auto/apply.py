"""``parallelize_semi_auto``: turn a single-device model with shard tags into a DTensor model.

In this order, all checks before any change:

1. collect the tags: ``parallel.shard`` calls already made, plus ``strategies=`` (path ->
   strategy);
2. derive every tagged module's and sharded operator's plan on ``device_num`` devices, check each
   parameter's shape against its layout, and find (with torch.fx) the parameters that sharded
   operators consume; a parameter shared by two consumers (tied weights) must get one layout;
3. build one DeviceMesh that every plan fits (``mesh.mesh_shape_for``);
4. convert every parameter to a DTensor (``distribute_tensor`` from rank 0's values, so replicas
   agree): its layout's placements, or ``Replicate`` for untagged modules; buffers replicated;
   a meta parameter (deferred initialization) gets storage for its block only
   (``parallel.weights.deferred_spmd``), filled after the last step;
5. hook the modules like torch's ``parallelize_module`` does: a tagged module's input is
   redistributed to its layout before ``forward`` (and its output placed by ``out_strategy``),
   plain tensors entering any module become replicated DTensors, the model's outputs come back
   as ordinary full tensors, and a parameter's gradient is reduced to the parameter's own
   placements once accumulated (``Partial`` sums over the ranks that shared its work).

Modules tagged for the host with ``hetero.set_device`` are placed first, by whole modules: in
steps 4–5 their parameters, buffers and hooks use the host twin of the mesh, and hooks at the
boundaries move activations between the two (``host.py`` says why in this order).

With ``full_batch=True`` every rank feeds the same, whole batch, as a single-device model
expects. With ``full_batch=False`` (MindSpore's dataset strategy) the ``data`` ranks of the outer
mesh dimensions each feed their own slice of it: the root's tensor inputs become DTensors sharded
on dim 0 over those dimensions, so the model still computes on the global batch (a mean loss is
the global mean). With ``pipeline`` stages all of this happens inside this rank's stage, on the
sub-mesh of its ``device_num = world / pipeline`` ranks.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

import foundation.device as hd
from hetero.local_parts import DTENSOR_COMPUTE_ATTR
from parallel.context import resolve_device_num
from parallel.semi_auto.execute import to_dtensor
from parallel.semi_auto.hooks import install_hooks, reduce_grad
from parallel.semi_auto.host import HOST, host_placement, host_twin, install_boundaries
from parallel.semi_auto.layout import TensorLayout
from parallel.semi_auto.mesh import device_mesh, mesh_shape_for, placements
from parallel.semi_auto.shard import (
    ModuleShard,
    ShardedOp,
    attach_module_tag,
    make_module_tag,
    module_tag,
)
from parallel.semi_auto.strategy import OpPlan, check_shapes
from parallel.semi_auto.strategy_file import match_strategies
from parallel.semi_auto.trace import parameter_uses, sharded_ops
from parallel.weights.deferred_spmd import empty_dtensor, empty_replicated


@dataclasses.dataclass
class SemiAutoModel:
    """What parallelize did to one model (read by ``explain_sharding``)."""

    device_num: int
    mesh: DeviceMesh
    modules: dict[str, tuple[nn.Module, ModuleShard, OpPlan]]
    ops: dict[str, ShardedOp]
    param_layouts: dict[str, tuple[TensorLayout, str]]  # name -> (layout, which consumer)
    untraced: list[str]
    host: list[str] = dataclasses.field(default_factory=list)  # modules placed on the host


_STATE_ATTR = "_parallel_semi_auto"


def semi_auto_state(model: nn.Module) -> SemiAutoModel | None:
    """What ``parallelize_semi_auto`` did to ``model``, kept on the model itself (as torch's
    composable APIs keep their state), or None."""
    return model.__dict__.get(_STATE_ATTR)


_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)


def _check_dropout(model: nn.Module) -> None:
    """DTensor keeps random ops consistent across ranks only where the device can set its RNG
    state (``is_rng_supported_mesh``: GPU-like accelerators, not CPU). Elsewhere ranks holding
    the same slice would draw different dropout masks and silently drift apart, so refuse."""
    device_type = hd.resolve("device").type
    handle = getattr(torch, device_type, None)
    if handle is not None and hasattr(handle, "set_rng_state"):
        return
    for path, module in model.named_modules():
        if isinstance(module, _DROPOUTS) and module.p > 0:
            raise ValueError(f"{path} ({type(module).__name__}, p={module.p}): DTensor has no "
                             f"random-number tracker on {device_type} meshes, so ranks holding "
                             f"the same slice would draw different dropout masks; use p=0 "
                             f"(e.g. model.dropout=0.0) for semi-auto parallel on {device_type}")


def _parameter_names(model: nn.Module) -> dict[int, str]:
    """Each parameter's first name (the one ``named_parameters`` and state dicts use)."""
    return {id(p): n for n, p in reversed(list(model.named_parameters(remove_duplicate=False)))}


def _same_layout(a: TensorLayout, b: TensorLayout) -> bool:
    """Equal layouts, or ones that place the tensor alike: both whole on every device, or the
    same placements on the coarsest mesh both device matrices fit (then on any finer mesh too,
    which the model's mesh is)."""
    if a == b or all(n == 1 for n in (*a.slices(), *b.slices())):
        return True
    if a.slices() != b.slices():
        return False
    try:
        shape = mesh_shape_for([a.device_matrix, b.device_matrix], math.prod(a.device_matrix))
        return placements(a, shape) == placements(b, shape)
    except ValueError:  # the matrices do not nest: they cannot share one mesh
        return False


def _param_layouts(model: nn.Module, modules: dict, device_num: int
                   ) -> tuple[dict[str, tuple[TensorLayout, str]], list[str], list[OpPlan]]:
    names = _parameter_names(model)
    chosen: dict[int, tuple[str, TensorLayout, str]] = {}

    def claim(param: nn.Parameter, layout: TensorLayout, who: str) -> None:
        if param is None:
            return
        name = names[id(param)]
        if id(param) in chosen and not _same_layout(chosen[id(param)][1], layout):
            raise ValueError(f"parameter {name} is shared by {chosen[id(param)][2]} and {who}, "
                             f"which need different layouts ({chosen[id(param)][1]} vs {layout}); "
                             f"a shared (tied) parameter has one layout: give both the same "
                             f"slices for it")
        chosen.setdefault(id(param), (name, layout, who))

    for path, (module, tag, plan) in modules.items():
        for pname, index in tag.module_rule.params.items():
            claim(getattr(module, pname, None), plan.inputs[index], path)
    uses, untraced = parameter_uses(model, [m for m, _, _ in modules.values()])
    op_plans = []
    for use in uses:
        plan = use.op.plan(device_num, use.info)
        tensors: list[Any] = [None] * len(plan.inputs)
        tensors[use.index] = use.param
        check_shapes(plan, tensors)
        claim(use.param, plan.inputs[use.index], use.op_path)
        op_plans.append(plan)
    return {n: (layout, who) for n, layout, who in chosen.values()}, untraced, op_plans


def _stage_device_num(explicit: int | None, pipeline: int, context: int = 1) -> int:
    """The ranks one stage's strategies spread over: the world over ``pipeline`` stages and
    ``context`` ranks splitting the sequence."""
    if not dist.is_initialized():
        raise RuntimeError("semi-auto parallel needs the process group: call parallel.init() "
                           "first (it also works in a plain single process)")
    world, outside = dist.get_world_size(), pipeline * context
    what = f"{pipeline} pipeline stage(s)" + (f" × {context} context ranks" if context > 1
                                              else "")
    if world % outside:
        raise ValueError(f"semi-auto parallel: {what} do not divide the world size {world}")
    device_num = resolve_device_num(explicit) if outside == 1 else (explicit or world // outside)
    if device_num * outside != world:
        raise ValueError(f"semi-auto parallel: device_num={device_num} must equal the world size "
                         f"{world} over {what}: the strategies spread each stage over all of "
                         f"its ranks")
    return device_num


def batch_mesh_dims(shape: tuple[int, ...], data: int | None) -> tuple[int, ...]:
    """The outer mesh dims whose sizes multiply to ``data`` (the dataset strategy's batch axis)."""
    if data is None:
        raise ValueError("semi-auto parallel with full_batch=False needs data= (how many ranks "
                         "each feed their own slice of the batch)")
    size = 1
    for j, dim in enumerate(shape):
        if size == data:
            return tuple(range(j))
        size *= dim
    if size == data:
        return tuple(range(len(shape)))
    raise ValueError(f"semi-auto parallel with full_batch=False: data={data} ranks are not a "
                     f"block of outer dimensions of the strategies' device mesh {shape}; give "
                     f"strategies whose device matrices start with the data-parallel axis")


def parallelize_semi_auto(model: nn.Module, *, device_num: int | None = None,
                          strategies: Mapping[str, Any] | None = None, pipeline: int = 1,
                          full_batch: bool = True, data: int | None = None,
                          replicated_on_batch: bool = False,
                          batch_boundary: bool = False, context: int = 1,
                          tensor: int = 1) -> nn.Module:
    """Shard ``model`` in place by its tags (and ``strategies``); returns it (see module doc).
    ``replicated_on_batch``: refuse, before any change, a parameter whose strategy splits it
    along the ``data`` ranks' mesh dims (optimizer parallel shards it there itself).
    ``batch_boundary``: the mesh has dims of exactly the ``data`` ranks outermost (MoE layers
    split their rows over them: ``parallel.expert.semi_auto``). ``context``: ranks splitting the
    sequence outside the strategies' ranks (``tensor``: the tensor degree they sit outside of,
    :func:`.mesh.device_mesh`); each of them runs the same sharded model on its tokens."""
    device_num = _stage_device_num(device_num, pipeline, context)
    if semi_auto_state(model) is not None:
        raise ValueError(f"{type(model).__name__} is already parallelized")
    _check_dropout(model)
    placement = host_placement(model)
    new_tags = {path: (module, make_module_tag(
        module, ins, outs, f"{path} ({type(module).__name__})"))
                for path, (module, ins, outs) in match_strategies(model, strategies or {}).items()}
    for path, (module, _) in new_tags.items():
        if module_tag(module) is not None:
            raise ValueError(f"module {path!r} already has a parallel.shard tag and strategies= "
                             f"gives it another; give it one")
    modules: dict[str, tuple[nn.Module, ModuleShard, OpPlan]] = {}
    for path, module in model.named_modules():
        tag = new_tags[path][1] if path in new_tags else module_tag(module)
        if tag is not None:
            what = f"{path or type(model).__name__} ({tag.kind})"
            plan = tag.plan(what, module, device_num)
            tag.check_parameters(plan, module)
            modules[path] = (module, tag, plan)
    param_layouts, untraced, op_plans = _param_layouts(model, modules, device_num)
    ops = {path: op for path, op in sharded_ops(model) if op.in_strategy is not None}
    matrices = [p.device_matrix for _, _, p in modules.values()] + [
        p.device_matrix for p in op_plans] + [op.plan(device_num).device_matrix
                                               for op in ops.values()]
    if (replicated_on_batch or batch_boundary or not full_batch) and data is not None \
            and device_num % data == 0:
        matrices.append((data, device_num // data))  # a mesh boundary after the data ranks
    shape = mesh_shape_for(matrices, device_num)
    batch_dims = () if full_batch else batch_mesh_dims(shape, data)
    if replicated_on_batch:
        _check_replicated_on_batch(param_layouts, shape, batch_mesh_dims(shape, data))
    # ---- everything checked: from here on the model changes
    for module, tag in new_tags.values():
        attach_module_tag(module, tag)
    mesh = device_mesh(shape, pipeline, context, tensor)
    meshes = {"device": mesh, HOST: host_twin(mesh)} if placement.any_host else {"device": mesh}
    _convert_parameters(model, {n: meshes[h] for n, h in placement.homes.items()},
                        {n: lay for n, (lay, _) in param_layouts.items()})
    install_hooks(model, meshes[placement.devices[""]], modules, batch_dims,
                  {id(m): meshes[placement.devices[p]] for p, m in model.named_modules()})
    install_boundaries(model, placement, meshes)
    for path, op in ops.items():
        op.mesh = meshes[placement.devices[path.rpartition(".")[0]]]
    if untraced:
        warnings.warn("parallel.parallelize: torch.fx could not trace " + "; ".join(untraced)
                      + ". Parameters its sharded operators consume stay replicated and are "
                        "sliced at every call (correct, but not memory-saving).", stacklevel=2)
    model.__dict__[_STATE_ATTR] = SemiAutoModel(
        device_num, mesh, modules, ops, param_layouts, untraced,
        [p for p in placement.boundaries() if placement.devices[p] == HOST])
    return model


def _check_replicated_on_batch(param_layouts: dict[str, tuple[TensorLayout, str]],
                               shape: tuple[int, ...], dims: tuple[int, ...]) -> None:
    for name, (layout, who) in param_layouts.items():
        where = placements(layout, shape, name)
        bad = [j for j in dims if not where[j].is_replicate()]
        if bad:
            raise ValueError(f"optimizer parallel: semi-auto parameter {name!r} is "
                             f"{where[bad[0]]} along data-parallel mesh dim {bad[0]} by the "
                             f"strategy of {who}; its strategy must replicate it on the batch "
                             f"axis, which optimizer parallel shards")


def _convert_parameters(model: nn.Module, meshes: dict[str, DeviceMesh],
                        layouts: dict[str, TensorLayout]) -> None:
    """Every parameter and buffer as a DTensor on ``meshes[its name]`` (its home's mesh: the
    tensor moves to that mesh's device), parameters laid out by ``layouts``."""
    converted: dict[int, nn.Parameter] = {}
    names = _parameter_names(model)
    for path, module in model.named_modules():
        for name, param in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            if id(param) not in converted:
                mesh = meshes[names[id(param)]]
                shape = tuple(mesh.shape)
                layout = layouts.get(names[id(param)])
                where = ([Replicate()] * mesh.ndim if layout is None
                         else placements(layout, shape, names[id(param)]))
                value = param.detach()  # a meta one: only this rank's block gets storage
                data = (empty_dtensor(value, mesh, where) if value.is_meta
                        else distribute_tensor(value, mesh, where))
                new = nn.Parameter(data, requires_grad=param.requires_grad)
                setattr(new, DTENSOR_COMPUTE_ATTR, True)  # for an offloading optimizer
                if new.requires_grad:
                    new.register_post_accumulate_grad_hook(reduce_grad)
                converted[id(param)] = new
            setattr(module, name, converted[id(param)])  # shared parameters stay shared
        for name, buf in list(module.named_buffers(recurse=False, remove_duplicate=False)):
            if not isinstance(buf, DTensor):
                mesh = meshes[f"{path}.{name}" if path else name]
                if buf.is_meta:  # deferred initialization fills it
                    buf = empty_replicated(buf, mesh)
                elif buf.device.type != mesh.device_type:  # homed on the other side
                    buf = buf.to(mesh.device_type)
                setattr(module, name, to_dtensor(buf, mesh, name))  # keeps it (non-)persistent
