"""Apply the ``parallel`` config group: build a ``parallel.ParallelConfig`` from Hydra and hand it
to ``parallel.parallelize`` explicitly (nothing goes through the global auto-parallel context)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from torch import nn

import parallel
from parallel import ParallelConfig, ParallelMode
from parallel.auto import applied_plan
from parallel.mesh import batch_mesh
from parallel.semi_auto import load_strategy_file
from recipes.optim import PARAM_DTYPES

STRATEGY_DIR = Path(__file__).resolve().parents[1] / "conf" / "strategy"
log = logging.getLogger(__name__)


def parallel_config(cfg: DictConfig, world_size: int, optim: DictConfig | None = None,
                    hetero: DictConfig | None = None) -> ParallelConfig:
    """The ``ParallelConfig`` the ``parallel`` group describes, resolved for ``world_size``;
    ``optim.parallel_optimizer`` (a level) shards the optimizer over the replicas, in
    ``hetero.param_dtype`` under ``hetero.offload_optimizer`` (each rank offloads its slice)."""
    optimizer_level = optim.get("parallel_optimizer") if optim is not None else None
    mode = ParallelMode(cfg.mode)
    if mode is ParallelMode.STAND_ALONE and world_size != 1:
        raise ValueError(
            f"parallel=none (stand-alone) trains in one process, but this job has "
            f"{world_size} ranks; use parallel=data to train data-parallel over all of them")
    if world_size % cfg.pipeline:
        raise ValueError(f"parallel.pipeline={cfg.pipeline} must divide the world size "
                         f"{world_size}")
    stage_ranks = world_size // cfg.pipeline
    model_parallel, strategies = 1, {}
    if mode is ParallelMode.SEMI_AUTO_PARALLEL:
        model_parallel = cfg.model_parallel or stage_ranks
        if stage_ranks % model_parallel:
            raise ValueError(f"parallel.model_parallel={model_parallel} must divide the "
                             f"{stage_ranks} ranks of a pipeline stage")
        strategies = _strategies(cfg, stage_ranks // model_parallel, model_parallel)
    elif mode is ParallelMode.AUTO_PARALLEL:
        if optimizer_level is not None or not cfg.full_batch:  # ranks a parameter may split
            model_parallel = cfg.model_parallel or 1
        if cfg.strategy:  # annotations ("mp": all ranks)
            strategies = _strategies(cfg, 1, stage_ranks)
    if optimizer_level is not None and (
            mode not in (ParallelMode.DATA_PARALLEL, ParallelMode.SEMI_AUTO_PARALLEL,
                         ParallelMode.AUTO_PARALLEL)
            or stage_ranks // model_parallel < 2):
        raise ValueError(f"optim.parallel_optimizer={optimizer_level} shards the optimizer over "
                         f"data-parallel replicas: use parallel=data (or parallel=semi_auto / "
                         f"auto with parallel.model_parallel below a stage's ranks) with at "
                         f"least 2 data ranks per stage (this job: parallel={cfg.name}, "
                         f"{world_size} ranks)")
    optimizer = {}
    if optimizer_level is not None:
        offload = hetero is not None and hetero.get("offload_optimizer")
        optimizer = dict(enable_parallel_optimizer=True, optimizer_level=optimizer_level,
                         parallel_optimizer_threshold=optim.parallel_optimizer_threshold,
                         param_dtype=PARAM_DTYPES[hetero.param_dtype] if offload else None)
    return ParallelConfig(
        mode=mode, pipeline=cfg.pipeline, model=model_parallel,
        micro_batches=cfg.micro_batches, schedule=cfg.schedule,
        virtual_stages=cfg.virtual_stages, stages=OmegaConf.to_container(cfg.stages),
        full_batch=cfg.full_batch if mode in (ParallelMode.SEMI_AUTO_PARALLEL,
                                              ParallelMode.AUTO_PARALLEL) else True,
        strategies=strategies, expert=cfg.expert, multi_copy=cfg.multi_copy,
        search_mode=cfg.search_mode, max_device_memory=cfg.max_device_memory, **optimizer,
    ).resolve(world_size)


def _strategies(cfg: DictConfig, dp: int, mp: int) -> dict[str, Any]:
    if not cfg.strategy:
        raise ValueError("parallel=semi_auto needs parallel.strategy: a file name in "
                         f"{STRATEGY_DIR} (e.g. gpt_megatron) or a path to a YAML file")
    path = Path(cfg.strategy)
    if path.suffix not in (".yaml", ".yml"):
        path = STRATEGY_DIR / f"{cfg.strategy}.yaml"
    return load_strategy_file(path, dp=dp, mp=mp)


def batch_slice(config: ParallelConfig) -> tuple[int, int]:
    """(index, count): which slice of the global batch this rank feeds — its data-parallel
    (× expert-parallel) rank's, or the whole batch (0, 1) where every rank of a stage feeds it
    (full_batch)."""
    if config.mode in (ParallelMode.SEMI_AUTO_PARALLEL, ParallelMode.AUTO_PARALLEL) and \
            config.full_batch:
        return 0, 1
    return batch_mesh(config).get_local_rank(), config.batch_ranks


def apply_parallel_mode(model: nn.Module, cfg: DictConfig, *,
                        loss_fn: Callable[[Any, Any], Any] | None = None,
                        example_inputs: tuple | None = None, optim: DictConfig | None = None,
                        hetero: DictConfig | None = None) -> tuple[nn.Module, ParallelConfig]:
    """``model`` parallelised as the ``parallel`` group says (a ``parallel.Pipeline`` when it has
    pipeline stages, which need ``loss_fn``), and the resolved config. Needs ``parallel.init()``.
    """
    config = parallel_config(cfg, parallel.get_world_size(), optim, hetero)
    if config.mode is ParallelMode.STAND_ALONE:
        return model, config
    if config.pipeline == 1:
        loss_fn = None  # the model computes its own loss
    model = parallel.parallelize(model, config, loss_fn=loss_fn, example_inputs=example_inputs)
    if config.pipeline > 1:
        log.info("%s", parallel.explain_pipeline(model))
    if isinstance(model, parallel.ShardedDataParallel):
        log.info("%s", model.explain())
    if config.mode is ParallelMode.SEMI_AUTO_PARALLEL:
        log.info("semi-auto plan (mp=%d, dp=%d):\n%s", config.model, config.data,
                 parallel.explain_sharding(model.module if config.pipeline > 1 else model))
    if config.mode is ParallelMode.AUTO_PARALLEL:
        log.info("%s", applied_plan(model).explain())
    return model, config
