"""Apply the ``parallel`` config group to a model: stand-alone, data or semi-auto parallel."""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig
from torch import nn

import parallel
from parallel import ParallelMode
from parallel.semi_auto import load_strategy_file

STRATEGY_DIR = Path(__file__).resolve().parents[1] / "conf" / "strategy"


def apply_parallel_mode(model: nn.Module, cfg: DictConfig) -> nn.Module:
    """Record the mode in parallel's auto-parallel context and wrap ``model`` for it.

    Needs ``parallel.init()`` first. ``parallel=none`` (STAND_ALONE) only makes sense with one
    rank: several ranks would each train their own copy on a slice of the batch.
    """
    mode = ParallelMode(cfg.mode)
    world_size = parallel.get_world_size()
    if mode is ParallelMode.STAND_ALONE:
        if world_size != 1:
            raise ValueError(
                f"parallel=none (stand-alone) trains in one process, but this job has "
                f"{world_size} ranks; use parallel=data to train data-parallel over all of them"
            )
        parallel.set_auto_parallel_context(parallel_mode=mode, device_num=1)
        return model
    if mode is ParallelMode.DATA_PARALLEL:
        parallel.set_auto_parallel_context(
            parallel_mode=mode, device_num=world_size, gradients_mean=True,
            parameter_broadcast=True,
        )
        return parallel.parallelize(model, ParallelMode.DATA_PARALLEL)
    if mode is ParallelMode.SEMI_AUTO_PARALLEL:
        return _semi_auto(model, cfg, world_size)
    raise NotImplementedError(
        f"parallel mode {mode.name} is not supported by this recipe yet; "
        f"use parallel=data, parallel=semi_auto or parallel=none"
    )


def _semi_auto(model: nn.Module, cfg: DictConfig, world_size: int) -> nn.Module:
    """Shard ``model`` by the strategy file ``cfg.strategy`` (``parallel.parallelize`` in
    semi_auto_parallel mode); every rank then trains on the whole global batch (full_batch)."""
    if not cfg.strategy:
        raise ValueError("parallel=semi_auto needs parallel.strategy: a file name in "
                         f"{STRATEGY_DIR} (e.g. gpt_megatron) or a path to a YAML file")
    mp = cfg.model_parallel or world_size
    if mp < 1 or world_size % mp:
        raise ValueError(f"parallel.model_parallel={mp} must divide the world size {world_size}")
    path = Path(cfg.strategy)
    if path.suffix not in (".yaml", ".yml"):
        path = STRATEGY_DIR / f"{cfg.strategy}.yaml"
    strategies = load_strategy_file(path, dp=world_size // mp, mp=mp)
    model = parallel.parallelize(model, ParallelMode.SEMI_AUTO_PARALLEL, device_num=world_size,
                                 strategies=strategies)
    logging.getLogger(__name__).info("semi-auto plan from %s (mp=%d, dp=%d):\n%s", path, mp,
                                     world_size // mp, parallel.explain_sharding(model))
    return model
