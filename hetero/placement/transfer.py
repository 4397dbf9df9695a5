"""The copy inserted at every partition boundary: differentiable, and asynchronous where it can be.

Host → accelerator copies go through pinned memory with ``non_blocking=True``, so the host thread
moves on while the DMA runs and later device work on the same stream is ordered after it.
Accelerator → host copies are blocking: the host reads the value right away, and a non-blocking
device-to-host copy would hand it memory the DMA has not filled yet. ``Tensor.to`` is already
differentiable; the autograd function exists so the gradient takes the same pinned, asynchronous
route back instead of a pageable copy.
"""

from __future__ import annotations

from typing import Any

import torch

from foundation import device as hd


class _Move(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        ctx.source = x.device
        return hd.copy_to(x, device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return hd.copy_to(grad, ctx.source), None


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` on ``device``: the tensor itself when already there, else a (differentiable)
    copy; non-tensors pass through."""
    if not isinstance(value, torch.Tensor) or value.device == device:
        return value
    if value.requires_grad and torch.is_grad_enabled():
        return _Move.apply(value, device)
    return hd.copy_to(value, device)
