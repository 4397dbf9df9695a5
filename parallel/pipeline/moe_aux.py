"""MoE balancing losses inside a pipeline: added to the training loss by the layers themselves.

A pipeline's ``loss_fn(output, target)`` runs on the last stage and sees only the model's output,
so it cannot add ``moe.aux_loss`` of layers other stages hold (a one-process model adds them to
its loss in ``forward``). As Megatron-LM's ``MoEAuxLossAutoScaler`` does, each MoE layer's output
carries its balancing loss into backward instead: forward passes the output through unchanged,
backward also sends the gradient ``scale`` into the layer's ``aux_loss`` — the gradient the loss
``aux_loss / scale`` would get, scaled like the user's loss (``1 / micro-batches``). Each
micro-batch's balancing loss is recorded, so ``Pipeline.step`` reports the step's mean loss with
them, as a one-process model reports ``lm_loss + Σ aux_loss``. Only each layer's last
``micro_batches`` records of a step count: at its first step torch's schedule also runs every
stage once on placeholder tensors to learn the shapes it exchanges (metadata inference).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import foundation.device as hd
from parallel.nn import MoE


class _AuxLossInBackward(torch.autograd.Function):
    """Identity on ``output``; backward also gives ``aux_loss`` the gradient ``scale``."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux_loss: torch.Tensor,
                scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(aux_loss)
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.scale), None


class StageAuxLosses:
    """The balancing losses of the MoE layers of this rank's stages (see the module
    docstring): ``scale`` is the gradient each gets per micro-batch (1 / the pipeline's loss
    scale)."""

    def __init__(self, model: nn.Module, scale: float) -> None:
        self.values: dict[int, list[torch.Tensor]] = {}
        self.scale = scale
        for module in model.modules():
            if isinstance(module, MoE):
                module.register_forward_hook(self._hook)

    def _hook(self, module: MoE, args: tuple, output: torch.Tensor) -> torch.Tensor:
        aux = module.aux_loss
        self.values.setdefault(id(module), []).append(aux.detach().float())
        if not (torch.is_grad_enabled() and aux.requires_grad):
            return output
        return _AuxLossInBackward.apply(output, aux, self.scale)

    def take(self, micro_batches: int) -> torch.Tensor:
        """The sum of each layer's balancing losses of the step's ``micro_batches`` forwards
        (its last records; all records are then forgotten)."""
        total = torch.zeros((), dtype=torch.float32, device=hd.resolve("device"))
        for records in self.values.values():
            for value in records[-micro_batches:]:
                total = total + value.to(total.device)
        self.values.clear()
        return total
