"""Apply the ``hetero`` config group's placement: tag modules for the CPU and ``hetero.place``."""

from __future__ import annotations

import logging

import torch
from omegaconf import DictConfig
from torch import nn

import hetero

log = logging.getLogger(__name__)


def tag_cpu_modules(model: nn.Module, cfg: DictConfig) -> bool:
    """Tag ``cfg.cpu_modules`` for the host (``hetero.set_device``); whether there were any."""
    modules = dict(model.named_modules())
    unknown = [path for path in cfg.cpu_modules if path not in modules]
    if unknown:
        raise ValueError(
            f"hetero.cpu_modules names {unknown}, which the model does not have; its modules "
            f"include {[p for p in modules if p][:12]}"
        )
    for path in cfg.cpu_modules:
        hetero.set_device(modules[path], "cpu")
    return bool(cfg.cpu_modules)


def apply_placement(model: nn.Module, cfg: DictConfig, example: tuple[torch.Tensor, ...]
                    ) -> nn.Module:
    """Tag ``cfg.cpu_modules`` for the host and place ``model`` (unchanged when there are none).

    ``example`` is one batch of the shape training uses, so the plan is captured and logged now.
    """
    if not tag_cpu_modules(model, cfg):
        return model
    placed = hetero.place(model, example)
    log.info("placement:\n%s", hetero.explain(placed))
    return placed
