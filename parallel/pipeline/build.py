"""``build_pipeline``: split a model into stages, keep this rank's, and wrap them for a schedule.

In this order, every check before the model changes: the stage plan (tags or automatic split),
the schedule's micro-batch rule, the tied parameters between stages; then this rank's units are
kept (the rest released), ``stage_modes`` applies the per-stage modes (placement, semi-auto
sharding), ``multi_copy`` splits each stage's micro-batches into copies (copies.py), data
parallel wraps the stage over the ``dp`` ranks (with ``expert_degree > 1``: MoE experts sharded
over ``ep`` and the rest data-parallel over ``dp × ep``, which split the batch; in
hybrid parallel the stage's unmarked tensors are first made equal over its ``mp`` ranks,
whose collectives the model writes itself: ``parallel.hybrid_parallel``), each stage
becomes a torch ``PipelineStage`` on the ``pp`` process group, and torch's schedule runs them.
MoE layers add their balancing losses to the training loss themselves (``moe_aux.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import foundation.device as hd
from foundation.compat import check_stages_on_one_rank
from parallel.config import OperatorSplit, ParallelConfig
from parallel.data.replicas import DataParallel, context_replicas
from parallel.dims import ParallelDims, ProcessGroups
from parallel.expert.experts import apply_expert_parallel, check_expert_layers, moe_layers
from parallel.hybrid_parallel import check_hybrid, prepare_hybrid
from parallel.mesh import batch_mesh
from parallel.optimizer_parallel import ShardedDataParallel
from parallel.optimizer_parallel.apply import apply_optimizer_parallel
from parallel.pipeline.carve import carve
from parallel.pipeline.copies import check_copies, stage_copies
from parallel.pipeline.moe_aux import StageAuxLosses
from parallel.pipeline.offloaded_stage import OffloadedStage
from parallel.pipeline.partition import StagePlan, plan_stages
from parallel.pipeline.runtime import (
    Pipeline,
    PipelineParts,
    StageRunner,
    Tie,
    scaled_loss,
)
from parallel.pipeline.schedule import (
    SINGLE,
    check_micro_batches,
    num_stages,
    rank_stages,
    schedule_class,
    stage_rank,
)
from parallel.pipeline.sharded_stage import ShardedStage
from parallel.pipeline.tags import stage_tags
from parallel.pipeline.verify import check_stages_run
from parallel.weights.deferred_init import materialize_pending


def make_plan(model: nn.Module, config: ParallelConfig,
              example_inputs: tuple | None = None) -> StagePlan:
    """The stage plan ``config`` gives ``model`` (no process group needed); with
    ``example_inputs`` every stage is also dry-run on fake tensors (``verify.py``)."""
    stages = num_stages(config.schedule, config.pipeline_degree, config.virtual_stages)
    check_micro_batches(config.schedule, config.micro_batches, config.pipeline_degree, stages)
    plan = plan_stages(model, stages, stage_tags(model, config.stages), example_inputs)
    if example_inputs is not None:
        check_stages_run(model, plan, example_inputs)
    return plan


def _tied(model: nn.Module, plan: StagePlan) -> list[dict[int, str]]:
    """Parameters held by units of more than one stage: stage -> name, per tied parameter."""
    modules = dict(model.named_modules())
    holders: dict[int, dict[int, str]] = {}
    for unit in plan.units:
        for name, param in modules[unit.path].named_parameters(remove_duplicate=False):
            holders.setdefault(id(param), {}).setdefault(plan.stage_of[unit.path],
                                                          f"{unit.path}.{name}")
    ties = [h for h in holders.values() if len(h) > 1]
    return sorted(ties, key=lambda h: h[min(h)])


def _tie_groups(ties: list[dict[int, str]], config: ParallelConfig, mesh: DeviceMesh,
                mine: list[int]) -> list[Tie]:
    """One process group per tied parameter and (dp, ep, tp) coordinate: the ranks holding
    it. Every rank creates every group, in the same order (``new_group`` is collective)."""
    ranks = mesh.mesh.reshape(config.pipeline_degree, -1)  # [pp, (dp, ep, tp)] -> global rank
    me = dist.get_rank()
    found = []
    for tie in ties:
        holders = sorted({stage_rank(config.schedule, s, config.pipeline_degree,
                                     config.virtual_stages)
                          for s in tie})
        group = None
        if len(holders) > 1:
            for column in range(ranks.shape[1]):
                members = [int(ranks[h, column]) for h in holders]
                made = ProcessGroups.get(members)
                if me in members:
                    group = made
        here = [s for s in tie if s in mine]
        if here:
            pp_rank = stage_rank(config.schedule, here[0], config.pipeline_degree,
                                 config.virtual_stages)
            found.append(Tie(tie[here[0]], group, count_here=pp_rank == holders[0]))
    return found


def build_pipeline(model: nn.Module, config: ParallelConfig, mesh: DeviceMesh, *,
                   loss_fn: Callable[[Any, Any], Any], example_inputs: tuple | None = None,
                   stage_modes: Callable[[nn.Module], nn.Module] | None = None,
                   wrap_stage: Callable[[nn.Module], nn.Module] | None = None,
                   data_parallel: bool = True) -> Pipeline:
    """This rank's ``Pipeline`` of ``model`` (changed in place: other stages' units are
    dropped). ``config`` is resolved; ``mesh`` is its ``(pp, dp, ep, mp)`` mesh. ``stage_modes``
    applies the per-stage modes; it may wrap the module only with one stage per rank.
    ``wrap_stage`` wraps each stage module the rank runs (a context split's
    ``ContextParallel``), however many."""
    if not callable(loss_fn):
        raise TypeError("pipeline parallel needs loss_fn(output, target): the last stage computes "
                        "the loss of each micro-batch")
    plan = make_plan(model, config, example_inputs)
    check_copies(model, config)
    ties = _tied(model, plan)
    if config.expert_degree > 1:  # on the whole model: a stage may hold none
        check_expert_layers(model, config.expert_degree)
    hybrid = config.operator_split is OperatorSplit.MODEL
    if hybrid:  # on the whole model: a stage may hold only replicated layers
        check_hybrid(model, config, mesh)
    with_moe = bool(moe_layers(model))
    dims = ParallelDims(config)  # the same meshes as ``mesh``'s regroupings
    pp_mesh = mesh["pp"]
    pp_rank = pp_mesh.get_local_rank()
    mine = rank_stages(config.schedule, pp_rank, config.pipeline_degree, config.virtual_stages)
    units = {u.path for u in plan.units}
    if config.schedule == "zbv":
        check_stages_on_one_rank(hd.group_backend(pp_mesh.get_group(), hd.resolve("device")))
    # ---- everything checked: from here on the model changes
    tie_list = _tie_groups(ties, config, mesh, mine)
    carve(model, {u for s in mine for u in plan.stage_units(s)}, units, in_place=True)
    runner = stage_modes(model) if stage_modes is not None else model
    submods = [runner] if len(mine) == 1 else [
        carve(model, set(plan.stage_units(s)), units, in_place=False) for s in mine]
    if wrap_stage is not None:
        submods = [wrap_stage(m) for m in submods]
    runners = [StageRunner(m) for m in stage_copies(runner, submods, config.multi_copy)]
    dp: DataParallel | ShardedDataParallel | None = None
    if hybrid:  # the stage's unmarked tensors over its mp; then as data parallel
        prepare_hybrid(model, config, mesh, checked=True)
    if config.enable_parallel_optimizer:
        # each stage's runner is an FSDP2 root: torch's schedules then accumulate the
        # micro-batches' gradients whole and reduce-scatter them once per step and stage (the
        # multi-stage runtime also gathers and reshards each stage around its compute)
        dp = apply_optimizer_parallel(model, config, root=runners)
    elif data_parallel and (config.expert_degree > 1 or (config.replica_ranks > 1 and with_moe)):
        # MoE experts sharded over ep, routing agreed over the stage's dp × ep × cp ranks
        dp = apply_expert_parallel(model, config, require=False)
    elif data_parallel and config.replica_ranks > 1:  # data × context replicas
        dp = DataParallel(model, gradients_mean=config.gradients_mean,
                          parameter_broadcast=config.parameter_broadcast,
                          group=dims["replicas"].get_group())
    elif dims.cp > 1:  # strategies: each context rank's sharded stage, averaged over cp
        dp = context_replicas(model, dims["cp"].get_group())
    materialize_pending(model)  # deferred init with no data-parallel wrapper to do it
    group = pp_mesh.get_group()
    device = hd.resolve("device")
    stage_cls = ShardedStage if config.enable_parallel_optimizer else OffloadedStage
    stages = [stage_cls(r, s, plan.num_stages, device, group=group)
              for r, s in zip(runners, mine, strict=True)]
    # ranks of a stage that feed their own slices: (Sharded)DataParallel averages their
    # gradients; under semi-auto's dataset strategy DTensor (and optimizer parallel over it)
    # sums them, so the loss is divided by their count
    sliced = config.batch_ranks > 1 and (data_parallel or not config.full_batch)
    averaged = dp is not None and data_parallel
    loss_scale = config.micro_batches * (config.data_degree if sliced and not averaged else 1)
    cls = schedule_class(config.schedule)
    schedule = cls(stages[0] if config.schedule in SINGLE else stages,
                   n_microbatches=config.micro_batches,
                   loss_fn=scaled_loss(loss_fn, loss_scale), scale_grads=False)
    last = stage_rank(config.schedule, plan.num_stages - 1, config.pipeline_degree,
                      config.virtual_stages)
    context = dims["cp"] if config.context_degree > 1 else None
    loss_group = (dims["replicas"].get_group() if context is not None
                  else batch_mesh(config).get_group() if sliced else None)
    parts = PipelineParts(plan, schedule, stages, config.schedule, config.micro_batches, group,
                          dist.get_global_rank(group, last), tie_list, dp, loss_scale,
                          loss_group,
                          aux=StageAuxLosses(model, 1.0 / loss_scale) if with_moe else None,
                          context=(context.get_local_rank(), config.context_degree)
                          if context is not None else None)
    return Pipeline(model, parts, dry_run=example_inputs is not None)
