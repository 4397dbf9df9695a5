"""Data parallel over host gradients: each rank's gradients, in host memory, averaged in buckets.

Parameter offload lands every gradient on the host at the end of backward; with several ranks
they are averaged there (ZeRO-Offload reduces on the host the same way) rather than on the device,
where they no longer are. A bucket's gradients are packed into one flat buffer, summed by one
all-reduce (gloo's host path), divided by the ranks (gloo has no average) and copied back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from foundation.errors import collective_guard

_WHAT = "parameter offload's gradient all_reduce (data parallel on the host)"


def average_host_grads(params: list[nn.Parameter], group: dist.ProcessGroup,
                       bucket_bytes: int) -> None:
    """Average the host gradients of ``params`` over ``group`` (every rank lists the same
    parameters in the same order). A parameter without a gradient on this rank sends zeros and
    gets the average if another rank had one."""
    ranks = dist.get_world_size(group)
    buckets: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in params:
        if size and size + p.nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.nbytes
    with collective_guard(_WHAT, group):
        for bucket in buckets:
            if not bucket:
                continue
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p))
                              .reshape(-1) for p in bucket])
            dist.all_reduce(flat, group=group)
            flat.div_(ranks)
            offset = 0
            for p in bucket:
                part = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
                if p.grad is not None:
                    p.grad.copy_(part)
                elif bool(part.any()):
                    p.grad = part.clone()
