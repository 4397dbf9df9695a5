"""Apply the ``parallel`` config group to a model: stand-alone or data parallel."""

from __future__ import annotations

import torch
from omegaconf import DictConfig
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import parallel
from parallel import ParallelMode


def apply_parallel_mode(model: nn.Module, cfg: DictConfig, device: torch.device) -> nn.Module:
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
        # torch's DDP for now; replaced by parallel.DataParallel in a later issue.
        return DistributedDataParallel(model, device_ids=None if device.type == "cpu" else [device])
    raise NotImplementedError(
        f"parallel mode {mode.name} is not supported by this recipe yet; "
        f"use parallel=data or parallel=none"
    )
