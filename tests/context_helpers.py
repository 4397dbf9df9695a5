"""The check every context-parallel test makes: the mean of the ranks' losses (each the mean
over its tokens) is one process's loss, and every gradient is one process's (rel 1e-5)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def world_mean(loss: torch.Tensor) -> torch.Tensor:
    """This rank's ``loss`` averaged over the world (each rank's is the mean over its tokens)."""
    mean = _full(loss).detach().clone()
    dist.all_reduce(mean)
    return mean / dist.get_world_size()


def assert_like_one_process(model: nn.Module, reference: nn.Module, loss: torch.Tensor,
                            want: torch.Tensor) -> None:
    """``loss`` (this rank's, after its backward) averaged over the world against ``want``,
    and ``model``'s gradients against ``reference``'s, parameter by parameter."""
    torch.testing.assert_close(world_mean(loss), want.detach(), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(_full(p.grad), q.grad, rtol=1e-5, atol=1e-6, msg=name)
