"""Optimizer and learning-rate schedule from the ``optim`` config group.

AdamW (decoupled weight decay on weight matrices only) or SGD with momentum, both driven by a
``LambdaLR`` that warms up linearly and then decays along a cosine to ``min_lr_ratio * lr``. The
schedule is a plain function of the step, so a checkpoint only needs the scheduler's step count.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from omegaconf import DictConfig
from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: weight matrices (decayed) and everything else, embeddings included (not)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 and id(p) not in embeddings else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: DictConfig) -> torch.optim.Optimizer:
    """``torch.optim.AdamW`` for ``optim=adamw``, ``torch.optim.SGD`` for ``optim=sgd``."""
    groups = param_groups(model, cfg.weight_decay)
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)
    raise ValueError(f"unknown optimizer optim.name={cfg.name!r}; options: adamw, sgd")


def warmup_cosine(warmup_steps: int, total_steps: int, min_ratio: float) -> Callable[[int], float]:
    """LR multiplier for scheduler step s (s optimizer steps already taken)."""
    def factor(s: int) -> float:
        if s < warmup_steps:
            return (s + 1) / warmup_steps
        progress = min(1.0, (s - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: DictConfig,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over ``cfg.warmup_steps``, cosine decay until ``total_steps``."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
    )
