"""Hybrid composition: ``parallel.parallelize(model, config)`` applies a ``ParallelConfig``.

The order, one small function each (torchtitan's ``parallelize_*`` are the model):

1. ``apply_pipeline`` on ``pp``: this rank keeps only its stages' layers (module deletion) — so
   every later step works on, and allocates for, just this rank's part. Then, per stage:
2. ``apply_placement``: modules tagged with ``hetero.set_device`` are placed (``hetero.place``;
   where the model splits its own operators (hybrid) and under optimizer parallel by whole
   modules, so the model's own collectives and FSDP2's module hooks run as written);
   where strategies (given or searched) split them the sharding places them itself, by whole
   modules, on the host twin of its mesh (``parallel.semi_auto.host`` says why), so this step
   is skipped there;
3. ``apply_sharding`` on ``dp × ep × tp``: the given strategies (or the searched plan) shard
   the stage's operators;
4. ``apply_data_parallel`` on ``dp``: ``ContextParallel`` on ``cp`` when the sequence is split,
   then gradients averaged over the stage's replicas (``dp × cp``; under strategies, which
   carry the batch axis already, over ``cp`` alone); with optimizer parallel,
   ``ShardedDataParallel`` shards the optimizer over them instead; with expert parallel, MoE
   experts are sharded over ``ep`` and the rest is data-parallel (or optimizer-sharded) over
   ``dp × ep``; under strategies MoE layers are left out of step 3 (and of auto's
   planning) and made expert-parallel on their local rows instead
   (``parallel.expert.semi_auto``); in hybrid parallel, the model's own collectives
   span ``tp``: its unmarked tensors are made equal over ``tp`` (``parallel.hybrid_parallel``),
   and then the data-parallel duties are data parallel's, over the ranks that split the batch
   (``DataParallel`` over ``dp``, MoE experts over ``ep``, optimizer parallel's shards), never
   over ``tp``.

Without pipeline stages, 2–4 run on the whole model, and then ``multi_copy`` when the config asks
for copies.

A model on the meta device (deferred initialization, ``parallel.weights.deferred_init``) is recorded
before step 1 and gets storage and values where a step first needs them, for only what the rank
holds: data parallel's wrapper (after the stage split), expert parallel (after the experts are
cut to the rank's shards), optimizer parallel (after FSDP2 has sharded the parameters), else
after the last step; ``parallel.weights.deferred_modes`` refuses what is not built for it.

The mesh is the config's one ``(pp, dp, ep, cp, tp)`` ``DeviceMesh``; semi-auto's own mesh is a
sub-mesh of a stage's ranks (those of one ``cp`` coordinate, when the sequence is split).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

import hetero
from foundation.model_view import ModelView
from hetero.tags import set_device_tag
from parallel.auto.apply import Plan, apply_auto_parallel, auto_limits, plan_pipeline, planned
from parallel.auto.plan import StrategyPlan
from parallel.combinations import check_placement
from parallel.config import OperatorSplit, ParallelConfig
from parallel.context_parallel import ContextParallel
from parallel.data.replicas import DataParallel, context_replicas
from parallel.dims import ParallelDims
from parallel.expert.experts import apply_expert_parallel, moe_layers
from parallel.expert.semi_auto import parallelize_with_moe
from parallel.hybrid_parallel import deferred_splits, prepare_hybrid
from parallel.multi_copy import multi_copy
from parallel.optimizer_parallel import ShardedDataParallel
from parallel.optimizer_parallel.apply import apply_optimizer_parallel
from parallel.pipeline import Pipeline, explain_pipeline
from parallel.result import Parallelized
from parallel.semi_auto import explain_sharding, parallelize_semi_auto
from parallel.semi_auto.apply import semi_auto_state
from parallel.semi_auto.shard import carries_strategies
from parallel.semi_auto.strategy_file import match_strategies
from parallel.weights.deferred_init import defer, is_meta, materialize_pending
from parallel.weights.deferred_modes import check_deferred
from parallel.weights.deferred_spmd import meta_blocks
from parallel.weights.loading import fill_rank, remember
from parallel.weights.match import Weights, match_weights


def _tagged(model: nn.Module) -> bool:
    """Whether placement must split ``model``: a module other than one that honours its own tag
    (host MoE experts) carries a ``set_device`` tag."""
    return any(set_device_tag(m) and not getattr(m, "places_itself", False)
               for m in model.modules())


def apply_placement(model: nn.Module, config: ParallelConfig,
                    example_inputs: tuple | None = None) -> nn.Module:
    """``hetero.place`` the model when any module carries a ``set_device`` tag (else unchanged;
    a module that only declares its own placement, as a host ``EmbeddingLookup`` does, keeps
    itself there without a split). By whole modules (``mode="hooks"``), where the modules'
    own code must run: in hybrid parallel the model's collectives live in its autograd
    Functions (Megatron's copy into the parallel region all-reduces its gradient in backward),
    which a captured graph differentiates as their forward ops instead (the gradient all-reduce
    lost, the forward all-reduce differentiated as a sum: silently wrong gradients); under
    optimizer parallel FSDP2 gathers and reduces each unit in its module hooks
    (``parallel.optimizer_parallel.placed``)."""
    if isinstance(model, ModelView) or not _tagged(model):
        return model
    if config.operator_split is OperatorSplit.MODEL or config.enable_parallel_optimizer:
        return hetero.place(model, mode="hooks")
    return hetero.place(model, example_inputs)


def apply_sharding(model: nn.Module, config: ParallelConfig,
                   example_inputs: tuple | None = None,
                   plan: StrategyPlan | None = None) -> nn.Module:
    """Semi-auto strategies on the stage's ``dp × ep × tp`` ranks (patterns for layers another stage
    holds are skipped: they were checked against the whole model); under a search, the
    strategies planned from the annotations on a graph captured from ``example_inputs`` (or a
    pipeline stage's share of the whole model's ``plan``)."""
    # a meta model's blocks stay meta when optimizer parallel shards them again (and then
    # allocates only its shards): parallel.weights.deferred_spmd
    with meta_blocks(config.enable_parallel_optimizer):
        return _shard(model, config, example_inputs, plan)


def _shard(model: nn.Module, config: ParallelConfig, example_inputs: tuple | None,
           plan: StrategyPlan | None) -> nn.Module:
    with_moe = bool(moe_layers(model))
    if config.operator_split is OperatorSplit.SEARCH:
        def plan_and_shard(dense: nn.Module) -> nn.Module:  # MoE layers detached: not planned
            return apply_auto_parallel(dense, device_num=config.stage_ranks,
                                       strategies=None if plan else config.strategies,
                                       example_inputs=example_inputs,
                                       search_mode=config.search_mode, plan=plan,
                                       pipeline=config.pipeline_degree,
                                       full_batch=config.full_batch, batch_boundary=with_moe,
                                       **auto_limits(config, moe=with_moe))
        return parallelize_with_moe(model, config, plan_and_shard)  # MoE: expert parallel
    if config.operator_split is not OperatorSplit.STRATEGIES:
        return model
    paths = [p for p, _ in model.named_modules() if p]
    present = {pattern: s for pattern, s in config.strategies.items()
               if any(fnmatch.fnmatchcase(p, pattern) for p in paths)}

    def shard(dense: nn.Module) -> nn.Module:
        kept = [p for p, _ in dense.named_modules() if p]  # MoE layers detached: not theirs
        return parallelize_semi_auto(
            dense, device_num=config.stage_ranks // config.context_degree,
            pipeline=config.pipeline_degree, context=config.context_degree,
            tensor=config.tensor_degree,
            strategies={pattern: s for pattern, s in present.items()
                        if any(fnmatch.fnmatchcase(p, pattern) for p in kept)},
            full_batch=config.full_batch, data=config.batch_ranks,
            replicated_on_batch=config.enable_parallel_optimizer, batch_boundary=with_moe)
    return parallelize_with_moe(model, config, shard)  # MoE layers: expert parallel on rows


def apply_data_parallel(model: nn.Module, dims: ParallelDims) -> nn.Module:
    """``DataParallel`` over the ``dp`` ranks (replicas, more than one);
    ``ShardedDataParallel`` when the config enables optimizer parallel (under strategies on the
    data-parallel dims of the semi-auto mesh); with ``expert_degree > 1``, MoE experts sharded
    over ``ep`` and the rest data-parallel over ``dp × ep`` (``apply_expert_parallel``)."""
    config = dims.config
    if config.operator_split is OperatorSplit.MODEL:  # its checks, unmarked tensors over mp
        prepare_hybrid(model, config, dims.world_mesh)
    if config.enable_parallel_optimizer:
        return apply_optimizer_parallel(apply_context(model, dims, materialize=False), config)
    # hybrid parallel's data-parallel duties are data parallel's
    data = config.operator_split in (OperatorSplit.REPLICAS, OperatorSplit.MODEL)
    if data and (config.expert_degree > 1 or (config.replica_ranks > 1 and moe_layers(model))):
        return apply_expert_parallel(model, config)  # with the context split, when asked
    model = apply_context(model, dims, materialize=True)
    if not data and dims.cp > 1:  # strategies: each context rank's sharded model, averaged
        return context_replicas(model, dims["cp"].get_group())
    if not data or config.replica_ranks == 1:
        return model
    group = None if config.replica_ranks == dist.get_world_size() else \
        dims["replicas"].get_group()
    return DataParallel(model, gradients_mean=config.gradients_mean,
                        parameter_broadcast=config.parameter_broadcast, group=group)


def apply_context(model: nn.Module, dims: ParallelDims, *, materialize: bool) -> nn.Module:
    """``ContextParallel`` over the ``cp`` ranks (more than one): each runs its share of every
    sequence; their gradients are averaged with the data replicas' (``apply_data_parallel``),
    or the optimizer is sharded over both. ``materialize``: a meta model gets its values now
    (data parallel: every rank holds it whole), else where optimizer parallel shards it."""
    if dims.cp == 1:
        return model
    if materialize:
        materialize_pending(model)
    return ContextParallel(model, dims["cp"].get_group(),
                           method=dims.config.context_method.value)


def apply_pipeline(model: nn.Module, dims: ParallelDims, *,
                   loss_fn: Callable[[Any, Any], Any] | None, example_inputs: tuple | None,
                   plan: StrategyPlan | None) -> tuple[nn.Module, StrategyPlan | None]:
    """This rank's ``Pipeline`` with placement and sharding applied to its stages, and the
    auto-parallel plan of the whole model (planned before the split)."""
    from parallel.pipeline.build import build_pipeline, make_plan  # torch's pipelining: here

    config = dims.config
    if config.operator_split is OperatorSplit.STRATEGIES and moe_layers(model):
        raise ValueError("parallel.parallelize: MoE layers in a pipeline split by strategies are "
                         "not built yet; pipeline an MoE model without strategies (with "
                         "expert_degree=E to shard its experts)")
    if config.operator_split is OperatorSplit.SEARCH and plan is None:
        plan = plan_pipeline(model, config, make_plan(model, config, example_inputs),
                             example_inputs)

    def stage_modes(stage: nn.Module) -> nn.Module:
        return apply_sharding(apply_placement(stage, config), config, plan=plan)

    def on_its_tokens(stage: nn.Module) -> nn.Module:  # each stage module of the rank
        return ContextParallel(stage, dims["cp"].get_group(),
                               method=config.context_method.value, stage=True)
    return build_pipeline(model, config, dims.world_mesh, loss_fn=loss_fn,
                          example_inputs=example_inputs, stage_modes=stage_modes,
                          wrap_stage=on_its_tokens if dims.cp > 1 else None,
                          data_parallel=config.operator_split in (OperatorSplit.REPLICAS,
                                                                  OperatorSplit.MODEL)), plan


def apply_config(model: nn.Module, config: ParallelConfig, *,
                 loss_fn: Callable[[Any, Any], Any] | None = None,
                 example_inputs: tuple | None = None,
                 plan: Plan | None = None, init_seed: int | None = None,
                 weights: str | Path | None = None) -> Parallelized:
    """Everything ``config`` asks for, in the module docstring's order. A meta-device ``model``
    is initialized from ``init_seed`` (default: ``torch.initial_seed()``) after sharding, or
    read from ``weights`` (each rank its block); a real one loads ``weights`` at the end."""
    if config.strategies:
        match_strategies(model, config.strategies)  # every pattern names a module somewhere
    # the model's parallel.shard tags split it by strategies too: checked again, knowing them
    config = dataclasses.replace(config, strategy_tags=carries_strategies(model))
    if _tagged(model):
        check_placement(config)
    if config.multi_copy > 1 and config.enable_parallel_optimizer and not moe_layers(model):
        raise ValueError("parallel.parallelize: multi_copy with optimizer parallel splits MoE "
                         "layers' expert work into copies, and this model has no MoE layers "
                         "(FSDP2 overlaps its own gathers); drop multi_copy")
    if config.multi_copy > 1 and config.operator_split is OperatorSplit.MODEL and \
            not moe_layers(model):
        raise ValueError("parallel.parallelize: multi_copy in hybrid_parallel splits MoE layers' "
                         "expert work into copies, and this model has no MoE layers (its "
                         "tensor-parallel collectives are the model's own, which the framework "
                         "cannot interleave); drop multi_copy")
    if config.context_degree > 1 and moe_layers(model) and \
            config.operator_split is not OperatorSplit.REPLICAS:
        raise ValueError("parallel.parallelize: context_degree > 1 with MoE layers runs with "
                         "data, expert, pipeline and optimizer parallel; with split operators "
                         "it is not built yet (routing must be agreed over every rank holding "
                         "tokens); drop context_degree for this layout")
    dims = ParallelDims(config)  # resolves it: degrees checked against the world
    dims.check_nodes()
    config = dims.config
    if plan is not None and config.operator_split is not OperatorSplit.SEARCH:
        raise ValueError(f"parallel.parallelize: plan= is a searched plan, but the config has no "
                         f"search_mode (its operators split: {config.operator_split.value!r})")
    # a weights file is checked against the whole model before any step changes it
    matched = None if weights is None else match_weights(model, weights,
                                                         who="parallel.parallelize")
    deferred = is_meta(model)
    if deferred:  # checked and recorded before any step changes the model
        splits = deferred_splits(model, config, dims.world_mesh) \
            if config.operator_split is OperatorSplit.MODEL else {}
        if splits and matched is not None:
            raise ValueError("parallel.parallelize: weights= with hybrid_parallel slices (tensors "
                             "marked mark_model_parallel) is not built yet: a file holds whole "
                             "tensors, and reading a slice of them is not; load the model's own "
                             "slices, or materialize it and load before parallelize")
        defer(model, check_deferred(model, init_seed, _tagged(model),
                                    set(matched.keys) if matched else set()), weights=matched,
              splits=splits)
    elif init_seed is not None:
        raise ValueError("parallel.parallelize: init_seed is for a model built on the meta device "
                         "(deferred initialization); this one has its values already")
    remember(model)  # the whole model's names, for parallel.load_weights later
    if config.pipeline_degree > 1:
        pipe, plan = apply_pipeline(model, dims, loss_fn=loss_fn, example_inputs=example_inputs,
                                    plan=_whole_plan(plan))
        return _loaded(Parallelized(pipe, config, dims, plan, _accounts(pipe, config, plan)),
                       None if deferred else matched)
    if loss_fn is not None:
        raise ValueError("parallel.parallelize: loss_fn is for pipeline parallel "
                         "(ParallelConfig.pipeline_degree > 1); without stages compute the loss "
                         "as usual")
    if not config.shards_operators:  # semi-auto and auto place tagged modules themselves
        model = apply_placement(model, config, example_inputs)
    model = apply_sharding(model, config, example_inputs, plan=plan)
    plan = planned(model)
    unwrapped = model
    model = apply_data_parallel(model, dims)
    materialize_pending(unwrapped)  # deferred init that no wrapper needed earlier
    if config.multi_copy > 1:
        model = multi_copy(model, config.multi_copy)
    return _loaded(Parallelized(model, config, dims, plan, _accounts(model, config, plan)),
                   None if deferred else matched)


def _accounts(model: nn.Module, config: ParallelConfig, plan: StrategyPlan | None
              ) -> list[Callable[[], str]]:
    """What ``Parallelized.explain()`` prints after the mesh, in order: the pipeline's stages,
    the sharding layouts of a semi-auto or auto model, the auto-parallel plan, the optimizer
    shards."""
    accounts: list[Callable[[], str]] = []
    if isinstance(model, Pipeline):
        accounts.append(lambda: explain_pipeline(model))
    if config.shards_operators:
        inner = model
        while isinstance(inner, ModelView | Pipeline) and semi_auto_state(inner) is None:
            inner = inner.module
        if semi_auto_state(inner) is not None:
            accounts.append(lambda: explain_sharding(inner))
    if plan is not None:
        accounts.append(plan.explain)
    if isinstance(model, ShardedDataParallel):
        accounts.append(model.explain)
    return accounts


def _loaded(result: Parallelized, weights: Weights | None) -> Parallelized:
    """``result`` with ``weights`` (matched to the model it was given) loaded into what the rank
    holds: for a model that had its values already (a meta one read them as it was
    materialized)."""
    if weights is not None:
        fill_rank(result.model, weights, "parallel.parallelize")
    return result


def _whole_plan(plan: Plan | None) -> StrategyPlan | None:
    if plan is None or isinstance(plan, StrategyPlan):
        return plan
    raise ValueError("parallel.parallelize: with pipeline stages give plan= as a StrategyPlan "
                     "(each stage takes its share of it)")
