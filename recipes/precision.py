"""``trainer.precision=fp32|bf16|fp16``: autocast of the model's forward, and loss scaling.

``bf16`` and ``fp16`` run the model's forward (and the evaluation) under ``torch.autocast`` on the
training device: matmuls and attention in 16 bits, the weights, gradients and optimizer state in
fp32. The loss is always computed in fp32 from upcast logits (``recipes.gpt.lm_loss``), as
Megatron-LM and torchtitan do, so a logged loss is never a 16-bit-rounded value. ``fp16`` adds
dynamic loss scaling: ``parallel.grad_scaler.ShardedGradScaler`` (``torch.amp.GradScaler`` for
sharded gradients too, overflow agreed over the ranks) for a torch optimizer (on the host too),
``hetero.optim.LossScaler`` for ``OffloadAdamW``, whose gradients leave the device during
backward where ``GradScaler`` cannot see them.

With ``offload=optimizer`` the device weights are already 16-bit (``offload.param_dtype``): the
precision must then name the same 16-bit type (or stay ``fp32``, meaning "what the weights
are"); ``bf16`` over ``float16`` weights, or ``fp16`` over ``bfloat16`` ones, is refused.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from omegaconf import DictConfig

import foundation.device as hd
from hetero.optim import LossScaler, OffloadAdam
from parallel.grad_scaler import ShardedGradScaler

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
#: offload.param_dtype -> the trainer.precision it is
_PARAM_PRECISION = {"bfloat16": "bf16", "float16": "fp16"}


def check_bf16(cfg: DictConfig) -> list[str]:
    """The settings asking for bfloat16 on a device without it (the offload presets' weights
    default to it; the Ascend 910A and pre-Ampere GPUs have none), each with its fix."""
    offload = cfg.get("offload")
    asked = {"trainer.precision=bf16": cfg.trainer.get("precision", "fp32") == "bf16",
             "offload.param_dtype=bfloat16": offload is not None
             and offload.get("param_dtype") == "bfloat16"}
    if not any(asked.values()) or hd.supports_bf16():
        return []
    where = hd.device_model() or str(hd.resolve("device"))
    return [f"{name}: {where} has no bfloat16; use {_FP16_FIX[name]} (with loss scaling) or fp32"
            for name, on in asked.items() if on]


_FP16_FIX = {"trainer.precision=bf16": "trainer.precision=fp16",
             "offload.param_dtype=bfloat16": "offload.param_dtype=float16"}


def check_precision(cfg: DictConfig) -> list[str]:
    """What ``trainer.precision`` cannot do with the rest of the config (empty: fine)."""
    precision = cfg.trainer.get("precision", "fp32")
    problems = check_bf16(cfg)
    if precision == "fp32":
        return problems
    param_dtype = cfg.offload.param_dtype if cfg.hetero.get("offload_optimizer") else None
    if param_dtype is not None and _PARAM_PRECISION[param_dtype] != precision:
        problems.append(f"trainer.precision={precision} with offload.param_dtype={param_dtype}: "
                        f"the offloaded weights are {param_dtype}, so compute is too; set "
                        f"trainer.precision={_PARAM_PRECISION[param_dtype]} (or hetero."
                        f"param_dtype={'bfloat16' if precision == 'bf16' else 'float16'})")
    if precision == "fp16" and cfg.parallel.get("pipeline_degree", 1) > 1:
        problems.append("trainer.precision=fp16 needs loss scaling, which the pipeline schedules "
                        "do not apply (their backward runs inside pipe.step); use "
                        "trainer.precision=bf16 with pipeline stages")
    return problems


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to the precision's 16-bit type on ``device`` (nothing for fp32)."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    if not torch.amp.is_autocast_available(device.type):
        raise ValueError(f"trainer.precision={precision}: torch has no autocast for device "
                         f"type {device.type!r}; use trainer.precision=fp32")
    return torch.autocast(device.type, dtype=dtype)


def build_scaler(precision: str, optimizer: torch.optim.Optimizer, device: torch.device,
                 device_weights: torch.dtype | None = None) -> Any:
    """The loss scaler a step needs, or None: fp16 weights under offload (the optimizer's
    16-bit device weights, or ``device_weights``: parameter offload's device copies), or
    ``precision=fp16``."""
    if isinstance(optimizer, OffloadAdam):
        fp16 = (torch.float16 in (optimizer.param_dtype, device_weights)
                or precision == "fp16")
        return LossScaler() if fp16 else None
    if precision == "fp16":  # sharded (DTensor) gradients too, overflow agreed over the ranks
        return ShardedGradScaler(device.type)
    return None
