"""``parallel.parallelize(model, ParallelConfig(search_mode=...))``: plan, then apply the plan as
semi-auto.

The plan (:func:`~parallel.auto.plan.plan_auto_parallel`, or one given with ``plan=``: a
``StrategyPlan``, a saved plan's path, or its mapping) is split in two: strategies keyed by a
``parallel.shard`` operator's attribute path are assigned to that operator, and the rest (module
paths) go to semi-auto as ``strategies=``. Semi-auto then does everything it does for a
hand-written strategy map (layout checks, one mesh, DTensor parameters, hooks,
``explain_sharding``), so the numerics and autodiff it guarantees carry over. The layers a
``StrategyPlan`` recomputes (``plan.recompute``, chosen under ``max_device_memory``) are then
wrapped with ``parallel.recompute`` in the mode it names.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetero.placement import PlacedModule
from parallel.auto.plan import (
    SEARCH_MODES,
    StrategyPlan,
    load_plan,
    plan_auto_parallel,
    plan_recompute,
)
from parallel.config import ParallelConfig
from parallel.errors import collective_guard
from parallel.pipeline.partition import StagePlan
from parallel.recompute import recompute, recompute_mode
from parallel.semi_auto import parallelize_semi_auto
from parallel.semi_auto.shard import module_tag
from parallel.semi_auto.trace import sharded_ops

Plan = StrategyPlan | str | Path | Mapping[str, Any]
_PLAN_ATTR = "_parallel_auto_plan"


def planned(model: nn.Module) -> StrategyPlan | None:
    """The ``StrategyPlan`` :func:`apply_auto_parallel` applied to ``model`` (kept on the model,
    as torch's composable APIs keep their state); None when it was given as a file or mapping.
    ``parallelize`` hands it back as ``Parallelized.plan``."""
    return model.__dict__.get(_PLAN_ATTR)


def _strategy_map(plan: Plan) -> tuple[dict[str, Any], dict[str, str]]:
    """(strategies, recomputed layers) of a plan however it is given."""
    if isinstance(plan, StrategyPlan):
        return plan.strategies, plan.recompute
    return plan_recompute(load_plan(plan) if isinstance(plan, (str, Path)) else plan)


def apply_auto_parallel(model: nn.Module, *, device_num: int,
                        strategies: Mapping[str, Any] | None = None,
                        example_inputs: tuple | None = None,
                        search_mode: str = "sharding_propagation",
                        plan: Plan | None = None, pipeline: int = 1,
                        max_device_memory: float | None = None, data: int = 1,
                        optimizer_level: str | None = None,
                        full_batch: bool = True, batch_boundary: bool = False) -> nn.Module:
    """Plan ``model`` on ``device_num`` devices (or take ``plan``) and apply it in place.

    ``pipeline`` > 1: ``model`` is one stage and ``plan`` the whole model's (keys of other
    stages are skipped). ``data``/``optimizer_level``: the data axis optimizer parallel then
    shards (see ``plan_auto_parallel``); parameters are checked to be replicated along it.
    ``full_batch=False``: each of the ``data`` ranks feeds its own slice of the batch (semi-auto's
    dataset strategy: the root's inputs become DTensors sharded on dim 0 over the data axis);
    ``example_inputs`` are still the global batch the plan is made for. ``batch_boundary``: the
    ``data`` ranks are the outermost mesh dims (MoE layers run on their rows there:
    ``parallel.expert.semi_auto``)."""
    if search_mode not in SEARCH_MODES:
        raise ValueError(f"auto_parallel: search_mode {search_mode!r} is not one of "
                         f"{SEARCH_MODES}")
    if plan is None:
        if example_inputs is None:
            raise ValueError("auto_parallel plans on a captured graph: pass example_inputs (a "
                             "batch, or fake/meta tensors of its shape), or plan= a saved plan")
        plan = agreed(plan_auto_parallel(model, example_inputs, device_num=device_num,
                                         search_mode=search_mode,
                                         strategies=dict(strategies or {}),
                                         max_device_memory=max_device_memory, data=data,
                                         optimizer_level=optimizer_level))
    elif strategies:
        raise ValueError("auto_parallel: give annotations (strategies=) or a plan, not both")
    if isinstance(plan, StrategyPlan):
        model.__dict__[_PLAN_ATTR] = plan
    chosen, recomputed = _strategy_map(plan)
    ops = dict(sharded_ops(model))
    modules = dict(model.named_modules())
    unknown = [key for key in chosen if key not in ops and key not in modules]
    if pipeline > 1:  # the plan covers every stage; this rank holds one
        chosen = {key: value for key, value in chosen.items() if key not in unknown}
    elif unknown:
        raise ValueError(f"auto_parallel: the plan names {unknown}, which are neither modules "
                         f"nor parallel.shard operators of {type(model).__name__}")
    layers = _recompute_layers(model, recomputed, modules, pipeline)
    planned = {key: ops[key] for key in chosen if key in ops and ops[key].in_strategy is None}
    # every planned module is tagged, replicated ones too: left untagged, DTensor's own
    # per-operator propagation would choose their layouts again (measured: more collectives)
    module_map = {key: strategy for key, strategy in chosen.items()
                  if key in modules and module_tag(modules[key]) is None}
    try:
        for key, op in planned.items():
            op.assign(chosen[key])
        sharded = parallelize_semi_auto(model, device_num=device_num, strategies=module_map,
                                        pipeline=pipeline, data=data, full_batch=full_batch,
                                        replicated_on_batch=optimizer_level is not None,
                                        batch_boundary=batch_boundary)
    except Exception:
        for op in planned.values():  # nothing half-applied: the operators wait for a plan again
            op.in_strategy, op.out_strategy, op.mesh = None, None, None
        raise
    for module, mode in layers.items():  # checked above: wrapping cannot fail half-way
        recompute(module, mode)
    return sharded


def _recompute_layers(model: nn.Module, wanted: Mapping[str, str],
                      modules: dict[str, nn.Module], pipeline: int) -> dict[nn.Module, str]:
    """The modules a plan recomputes (``wanted``: layer path -> mode) and their modes, checked
    before anything is applied: each
    named layer must be a module of ``model`` (with pipeline stages, layers of other stages are
    skipped) not recomputed already in another mode (one the user recomputed in the plan's mode
    is left as it is)."""
    if wanted and any(isinstance(m, PlacedModule) for m in (model, *modules.values())):
        raise ValueError(f"auto_parallel: the plan recomputes {sorted(wanted)}, and "
                         f"{type(model).__name__} is hetero.place'd (its forward runs captured "
                         f"partitions, which parallel.recompute cannot wrap); plan with "
                         f"plan_auto_parallel(..., recompute=False) for a placed model")
    found = {}
    for path, mode in wanted.items():
        module = modules.get(path)
        if module is None:
            if pipeline > 1:
                continue
            raise ValueError(f"auto_parallel: the plan recomputes '{path}', which is not a "
                             f"module of {type(model).__name__}")
        if recompute_mode(module) not in (None, mode):
            raise ValueError(f"auto_parallel: the plan recomputes '{path}' with mode {mode!r}, "
                             f"but it is already recomputed with {recompute_mode(module)!r}")
        if recompute_mode(module) is None:
            found[module] = mode
    return found


def auto_limits(config: ParallelConfig, moe: bool = False) -> dict[str, Any]:
    """The search's memory limit and data axis from a resolved config: with optimizer parallel
    its ``data`` ranks hold replicas the optimizer shards; with ``full_batch=False`` they each
    feed their own slice of the batch, which the plan must split over them; with MoE layers
    (``moe``) the ``data × expert`` ranks each run the layers on their own rows, so the plan
    keeps the batch split over all of them."""
    shards: dict[str, Any] = {}
    if config.enable_parallel_optimizer or not config.full_batch:
        shards["data"] = config.data_degree
    if moe:
        shards["data"] = config.batch_ranks
    if config.enable_parallel_optimizer:
        shards["optimizer_level"] = config.optimizer_level
    return {"max_device_memory": config.max_device_memory, **shards}


def micro_batch(example_inputs: tuple, micro_batches: int) -> tuple:
    """The first micro-batch of ``example_inputs`` (tensors sliced along dim 0)."""
    return tuple(x[: x.shape[0] // micro_batches]
                 if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] % micro_batches == 0
                 else x for x in example_inputs)


def plan_pipeline(model: nn.Module, config: ParallelConfig, stages: StagePlan,
                  example_inputs: tuple | None) -> StrategyPlan:
    """The whole model planned stage by stage on one micro-batch, each stage's operators over
    its own ``config.stage_ranks`` devices (``stages``: the pipeline's split)."""
    if example_inputs is None:
        raise ValueError("auto_parallel with pipeline stages plans on a captured graph: pass "
                         "example_inputs (a batch, or fake/meta tensors of its shape)")
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    return agreed(plan_auto_parallel(model, micro_batch(example_inputs, config.micro_batches),
                                     device_num=config.stage_ranks,
                                     search_mode=config.search_mode,
                                     strategies=dict(config.strategies),
                                     stages=stages.stage_of, **auto_limits(config)))


def agreed(plan: StrategyPlan) -> StrategyPlan:
    """Rank 0's plan, on every rank. Each rank plans by itself from the profile its host saved;
    hosts whose profiles differ (measured apart, or one without a saved profile) would
    otherwise apply different strategies and issue mismatched collectives: a hang."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return plan
    box = [plan if dist.get_rank() == 0 else None]
    with collective_guard("auto_parallel plan broadcast from rank 0"):
        dist.broadcast_object_list(box, src=0)
    return box[0]
