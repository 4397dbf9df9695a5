"""The copy inserted at every partition boundary: differentiable, and asynchronous where it can be.

Host → accelerator copies go through pinned memory with ``non_blocking=True``, so the host thread
moves on while the DMA runs and later device work on the same stream is ordered after it.
Accelerator → host copies are blocking: the host reads the value right away, and a non-blocking
device-to-host copy would hand it memory the DMA has not filled yet. ``Tensor.to`` is already
differentiable; the autograd function exists so the gradient takes the same pinned, asynchronous
route back instead of a pageable copy.

A parameter homed on the host and lent to an accelerator partition every forward (a tied
embedding table whose output head runs on the device) would be copied into fresh pinned memory on
every forward. Its pinned copy is kept instead, on the parameter, and made again only when the
parameter's values change: its autograd version counter (every in-place write counts: torch's
optimizers, ``load_state_dict``, ``hetero.optim``'s host updates) or its storage
(``param.data = ...``) moved on. It costs one pinned copy of each such parameter in host memory.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from foundation import device as hd

_PINNED_ATTR = "_hp_pinned_copy"  # on a host parameter: ((version, data_ptr), pinned copy)


def pinned_source(x: torch.Tensor) -> torch.Tensor:
    """What a host→accelerator copy of ``x`` reads: for a host parameter its pinned copy, made
    once per version of its values (see the module docstring); anything else as it is."""
    if not isinstance(x, nn.Parameter) or x.device.type != "cpu" or not hd.can_pin():
        return x
    stamp = (x._version, x.data_ptr())
    cached = getattr(x, _PINNED_ATTR, None)
    if cached is None or cached[0] != stamp:
        cached = (stamp, hd.pin(x.detach()))
        setattr(x, _PINNED_ATTR, cached)
    return cached[1]


def _copy(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cpu":
        x = pinned_source(x)
    return hd.copy_to(x, device)


class _Move(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        ctx.source = x.device
        return _copy(x, device)

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
    return _copy(value, device)
