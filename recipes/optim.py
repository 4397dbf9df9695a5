"""Optimizer and learning-rate schedule from the ``optim`` config group.

The optimizer is the group's ``optimizer`` node built by ``hydra.utils.instantiate`` (``_target_``:
``torch.optim.AdamW``, ``torch.optim.SGD``, or any optimizer class; torch's AdamW, Adam and SGD
fused where the weights are on a GPU, unless the config says ``fused`` or ``foreach``) over two
parameter groups
(weight decay on weight matrices only), driven by a ``LambdaLR`` that warms up linearly and then
decays along a cosine to ``min_lr_ratio * lr``. The schedule is a plain function of the step, so a
checkpoint only needs the scheduler's step count. With ``hetero.offload_optimizer`` the target
becomes ``hetero.optim.OffloadAdamW`` (FP32 state on the host, 16-bit weights on the device);
``backward_and_step`` then clips the host gradients and adds fp16 loss scaling.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn

import foundation.device as hd
import parallel
from foundation.validate import check_clip_args, check_count, check_number
from hetero.optim import LossScaler, OffloadAdam, OffloadAdamW
from parallel.grad_clip import clip_grad_norm_
from recipes.schedules import check_schedule, lr_factor

log = logging.getLogger(__name__)

PARAM_DTYPES = {None: None, "bfloat16": torch.bfloat16, "float16": torch.float16}


def embedding_names(model: nn.Module) -> set[str]:
    """Every name of every embedding weight, tied aliases included (``lm_head.weight`` when the
    head shares the token embedding). Taken on the whole model: a pipeline stage holding only
    the head no longer sees that its weight is an embedding, yet must treat it alike."""
    ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return {n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in ids}


def param_groups(model: nn.Module, weight_decay: float,
                 embeddings: set[str] | None = None) -> list[dict]:
    """Two groups: weight matrices (decayed) and everything else, embeddings included (not).
    ``embeddings``: :func:`embedding_names` of the whole model (default: of ``model``)."""
    embeddings = embedding_names(model) if embeddings is None else embeddings
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 and name not in embeddings else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: DictConfig, hetero: DictConfig | None = None,
                    embeddings: set[str] | None = None, offload: DictConfig | None = None,
                    state_dir: Path | None = None, shard_group: Any = None
                    ) -> torch.optim.Optimizer:
    """``cfg.optimizer`` instantiated over :func:`param_groups`; ``hetero.optim.OffloadAdamW``
    with the same arguments when the optimizer state lives on the host (``offload.optimizer=
    host``, which ``hetero.offload_optimizer`` mirrors); ``hetero.offload.DiskAdamW`` in
    ``state_dir`` when it lives on disk; ``hetero.offload.sharded_host_adam.ShardedHostAdamW``
    over ``shard_group`` for host weights under optimizer parallel level1."""
    groups = param_groups(model, cfg.weight_decay, embeddings)
    if offload is not None and offload.optimizer == "disk":  # recipes/offload.py checked it
        return instantiate(cfg.optimizer, groups, _target_="hetero.offload.DiskAdamW",
                           _convert_="all", path=str(state_dir))
    if shard_group is not None:  # weights on the host, moments sharded over the data ranks
        return instantiate(cfg.optimizer, groups, _target_=(
            "hetero.offload.sharded_host_adam.ShardedHostAdamW"), _convert_="all",
            group=shard_group)
    host = offload.optimizer == "host" if offload is not None else \
        hetero is not None and hetero.get("offload_optimizer")
    if host and hetero is not None:
        return build_offload_adamw(groups, cfg, hetero,
                                   reduced_after_backward=isinstance(
                                       model, (parallel.data.DataParallel,
                                               parallel.pipeline.Pipeline,
                                               parallel.optimizer_parallel.ShardedDataParallel)),
                                   offload=offload)
    return instantiate(cfg.optimizer, groups, _convert_="all",
                       **fused_default(cfg.optimizer, model))


#: torch optimizers with a fused step that also takes a skip flag on the device
FUSABLE = ("torch.optim.AdamW", "torch.optim.Adam", "torch.optim.SGD")


def fused_default(optimizer: DictConfig, model: nn.Module) -> dict[str, bool]:
    """``{"fused": True}`` for a :data:`FUSABLE` optimizer whose config says neither ``fused``
    nor ``foreach``, over weights all on a device that fuses them
    (``foundation.device.fuses_optimizers``: one kernel a step, and a non-finite step skipped
    without the host waiting); else nothing."""
    if optimizer.get("_target_") not in FUSABLE or "fused" in optimizer or "foreach" in optimizer:
        return {}
    devices = {p.device for p in model.parameters()}
    return {"fused": True} if devices and all(hd.fuses_optimizers(d) for d in devices) else {}


def build_offload_adamw(groups: list[dict], cfg: DictConfig, hetero: DictConfig, *,
                        reduced_after_backward: bool = False,
                        offload: DictConfig | None = None) -> OffloadAdamW:
    """``optim.optimizer`` (an AdamW) as OffloadAdamW, with the ``hetero`` group's settings.
    ``reduced_after_backward`` (``DataParallel``, a pipeline's micro-batches): gradients
    stay on the device until they are reduced or accumulated, so they are copied out at
    ``step()`` rather than during backward. ``offload``: the ``offload`` group — its ratio is
    the host's share; under ``params=host`` the parameters are their own FP32 masters in host
    memory (the layers' device copies take ``hetero.param_dtype`` instead)."""
    if cfg.optimizer.get("_target_") != "torch.optim.AdamW":
        raise ValueError(f"hetero.offload_optimizer offloads AdamW, but optim={cfg.name} builds "
                         f"{cfg.optimizer.get('_target_')}; use optim=adamw or a hetero config "
                         f"without offload")
    params_home = offload is not None and offload.params != "device"
    return instantiate(cfg.optimizer, groups, _target_="hetero.optim.OffloadAdamW",
                       _convert_="all",
                       param_dtype=None if params_home else PARAM_DTYPES[
                           offload.param_dtype if offload is not None else hetero.param_dtype],
                       host_ratio=offload.ratio if offload is not None else 1.0,
                       kernel=hetero.offload_kernel, bucket_cap_mb=hetero.offload_bucket_mb,
                       overlap_backward=not reduced_after_backward,
                       host_threads=hetero.get("host_threads"))


def build_loss_scaler(optimizer: torch.optim.Optimizer) -> LossScaler | None:
    """A dynamic loss scaler when the optimizer holds fp16 device weights, else None."""
    if isinstance(optimizer, OffloadAdam) and optimizer.param_dtype is torch.float16:
        return LossScaler()
    return None


def scaled_backward(loss: torch.Tensor, scaler: LossScaler | None = None) -> None:
    """Backward from ``loss``, scaled first when fp16 weights need loss scaling."""
    (scaler.scale(loss) if scaler is not None else loss).backward()


def backward_and_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor,
                      grad_clip: float | None, scaler: LossScaler | None = None) -> None:
    """Backward, gradient clipping and the update; an offloaded optimizer clips its host
    gradients (the device ``.grad`` are gone by then) and fp16 goes through the loss scaler."""
    scaled_backward(loss, scaler)
    clip_and_step(model, optimizer, grad_clip, scaler)


def clip_and_step(model: nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float | None,
                  scaler: LossScaler | None = None) -> torch.Tensor | None:
    """Gradient clipping and the update, after one or more backward passes; returns the total
    gradient norm before clipping (None without clipping: no norm is computed then)."""
    norm = None
    if scaler is not None:
        scaler.unscale_(optimizer)
    if grad_clip is not None:
        check_clip_args("backward_and_step", grad_clip, 2.0)  # -1 would be gradient ascent
        if isinstance(optimizer, OffloadAdam):
            norm = optimizer.clip_grad_norm_(grad_clip)
        elif isinstance(model, (parallel.optimizer_parallel.ShardedDataParallel,
                                parallel.data.DataParallel)):
            norm = model.clip_grad_norm_(grad_clip)  # sharded (+ replicated) gradients
        else:  # torch's refuses a mix of plain and DTensor gradients, or several meshes
            norm = clip_grad_norm_(model.parameters(), grad_clip)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    return norm


def warmup_cosine(warmup_steps: int, total_steps: int, min_ratio: float) -> Callable[[int], float]:
    """LR multiplier for scheduler step s (s optimizer steps already taken): linear warm-up,
    cosine decay (``optim.schedule=cosine``, :mod:`recipes.schedules`)."""
    check_count("warmup_cosine", "warmup_steps", warmup_steps, low=0)
    check_count("warmup_cosine", "total_steps", total_steps, low=1)
    check_number("warmup_cosine", "min_ratio", min_ratio, 0.0)
    if min_ratio > 1:
        raise ValueError(f"warmup_cosine: invalid min_ratio={min_ratio} (must be <= 1)")
    return lr_factor("cosine", warmup_steps, total_steps, min_ratio)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: DictConfig,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """``cfg.schedule`` (default cosine) after a linear warm-up of ``cfg.warmup_steps``, over
    ``total_steps``; a warm-up as long as the run is reported (rank 0)."""
    schedule = cfg.get("schedule", "cosine")
    fraction = cfg.get("decay_fraction", 0.2)
    note = check_schedule(schedule, cfg.warmup_steps, total_steps, fraction)
    if note is not None and (not torch.distributed.is_initialized()
                             or torch.distributed.get_rank() == 0):
        log.warning("%s", note)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_factor(schedule, cfg.warmup_steps, total_steps, cfg.min_lr_ratio, fraction))
