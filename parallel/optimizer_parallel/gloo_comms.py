"""FSDP2's all-gather and reduce-scatter over gloo, as all-reduces.

Measured on this project's CPU box (2 gloo ranks, 9.4 M fp32 elements): ``all_reduce`` 24 ms,
``reduce_scatter_tensor`` 43 ms, ``all_gather_into_tensor`` 36 ms — gloo's ring all-reduce is
its tuned collective, the other two are not. An all-gather is an all-reduce (sum) of a zeroed
buffer holding each rank's slice in its place (exact: ``x + 0 == x``), and a reduce-scatter is an
all-reduce followed by keeping this rank's slice, so both take the fast path; the bytes on the
wire double, which gloo's ring more than repays. FSDP2 takes custom collectives through its
public ``set_custom_all_gather`` / ``set_custom_reduce_scatter``; on NCCL/HCCL the defaults
stay.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

# FSDP2's interfaces for custom collectives (public setters, classes not re-exported yet)
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter


def _empty(size: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(*size, dtype=dtype, device=device)


class AllReduceAllGather(AllGather):
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return _empty(size, dtype, device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> dist.Work | None:
        n = input_tensor.numel()
        start = dist.get_rank(group) * n
        output_tensor.zero_()
        output_tensor[start:start + n].copy_(input_tensor)
        return dist.all_reduce(output_tensor, group=group, async_op=async_op)


class AllReduceReduceScatter(ReduceScatter):
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return _empty(size, dtype, device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: object, async_op: bool = False) -> None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(f"reduce-scatter over gloo: reduce op {op} is not a sum or average")
        size = dist.get_world_size(group)
        dist.all_reduce(input_tensor, group=group)
        output_tensor.copy_(input_tensor.view(size, -1)[dist.get_rank(group)])
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(size)


def use_gloo_comms(root: nn.Module) -> None:
    """Give every FSDP module under ``root`` the all-reduce based collectives (call only when
    its groups are gloo)."""
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(AllReduceAllGather())
            module.set_custom_reduce_scatter(AllReduceReduceScatter())
