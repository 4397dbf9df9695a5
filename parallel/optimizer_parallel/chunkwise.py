"""All-gather and reduce-scatter over gloo as one broadcast / one reduce per rank's chunk.

gloo runs ``all_gather_single`` and ``reduce_scatter_single`` through flattening copies and a
generic ring, while its ``broadcast`` and ``reduce`` work in place on a contiguous chunk. Timed on
this project's 2-core host (37.6 MB, the optimizer-parallel benchmark's 9.4 M float32 weights,
median of 10): all-gather 44-48 ms on 2 ranks and 73-75 ms on 4, a broadcast from each rank of its
chunk 15-18 ms and 28-30 ms; reduce-scatter 62 ms and 97 ms, a reduce to each rank of its chunk
30 ms and 46 ms. torch's own ``ZeroRedundancyOptimizer`` gathers with broadcasts too. So on a
gloo group optimizer parallel gathers its weights and scatters its gradients this way (level1/2
in ``whole_weights.py``; level3 through FSDP2's public ``set_custom_all_gather`` /
``set_custom_reduce_scatter`` hooks), and on NCCL or HCCL the native collectives stay.

Both run to completion before returning (no ``Work``): FSDP2 waits only on a real ``dist.Work``,
and on the host there is no stream for an asynchronous collective to overlap with.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from foundation import device as hd


def chunkwise(group: dist.ProcessGroup | None, device_type: str) -> bool:
    """Whether ``group`` gathers and scatters ``device_type`` tensors faster chunk by chunk
    (its backend for them is gloo)."""
    return hd.gathers_chunkwise(hd.group_backend(group, torch.device(device_type)))


def use_chunkwise(root: nn.Module, mesh: DeviceMesh) -> None:
    """Give every FSDP2 unit under ``root`` (sharded over ``mesh``) these collectives when all of
    the mesh's groups gather chunkwise; else leave FSDP2's own."""
    if not all(chunkwise(g, mesh.device_type) for g in mesh.get_all_groups()):
        return
    for unit in root.modules():
        if isinstance(unit, FSDPModule):
            unit.set_custom_all_gather(GlooAllGather())
            unit.set_custom_reduce_scatter(GlooReduceScatter())


def _chunks(flat: torch.Tensor, parts: int) -> list[torch.Tensor]:
    size = flat.numel() // parts
    return [flat[r * size:(r + 1) * size] for r in range(parts)]


def broadcast_chunks(output: torch.Tensor, input: torch.Tensor,
                     group: dist.ProcessGroup | None) -> list[dist.Work]:
    """``all_gather_single(output, input)`` as one in-place broadcast per rank's chunk of
    ``output`` (this rank's chunk is ``input``, copied in unless it is that chunk already);
    returns the broadcasts' works, all issued."""
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    size = output.numel() // ranks
    mine = output.view(-1)[rank * size:(rank + 1) * size]
    if input.data_ptr() != mine.data_ptr():
        mine.copy_(input.view(-1))
    return broadcast_ranges(output.view(-1), [(r * size, (r + 1) * size) for r in range(ranks)],
                            group)


def broadcast_ranges(flat: torch.Tensor, ranges: Sequence[tuple[int, int]],
                     group: dist.ProcessGroup | None) -> list[dist.Work]:
    """Every rank's ``[start, end)`` of the 1-D ``flat`` (``ranges[r]``: rank r's, which it
    holds already) broadcast in place to the others: an all-gather whose parts may differ in
    size (uneven ``Shard(0)`` rows), empty ones skipped; returns the works, all issued."""
    return [dist.broadcast(flat[a:b], src=dist.get_global_rank(group, r) if group else r,
                           group=group, async_op=True)
            for r, (a, b) in enumerate(ranges) if b > a]


def reduce_chunks(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None,
                  op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
    """``reduce_scatter_single(output, input, op)`` as one reduce per rank's chunk of ``input``
    (which it uses as scratch), this rank's result copied into ``output``."""
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = _chunks(input.view(-1), ranks)
    _wait([dist.reduce(chunk, dst=dist.get_global_rank(group, r) if group else r, op=op,
                       group=group, async_op=True) for r, chunk in enumerate(chunks)])
    output.view(-1).copy_(chunks[rank])


class RangeReduce:
    """A reduce-scatter of the 1-D ``flat`` whose rank ``r`` part is the ranges ``ranges[r]``
    (``[start, end)`` pairs: a bucket's parameters each contribute their rows), by exchange:
    every rank sends each other rank that rank's ranges and adds up what the others send of
    its own. Issued at construction; :meth:`wait` (``dist.Work``'s) ends with this rank's ranges
    of ``flat`` holding the sums (the rest of ``flat`` as it was).

    Why by hand: ZeRO-2/3 keep only their rows, so a reduce-scatter suffices, and gloo has none
    worth using: its ``reduce_scatter`` flattens and rings (62 ms for 37.6 MB on 2 ranks) and its
    ``all_reduce`` moves twice the bytes a reduce-scatter must (24-28 ms on 2 ranks, 55-74 on 4);
    this exchange takes 13-15 ms and 28-33 ms on this project's 2-core host, each rank sending
    and receiving (N-1)/N of the bucket once, as a ring reduce-scatter does."""

    def __init__(self, flat: torch.Tensor, ranges: Sequence[Sequence[tuple[int, int]]],
                 group: dist.ProcessGroup | None) -> None:
        ranks, rank = dist.get_world_size(group), dist.get_rank(group)
        self.mine = [flat[a:b] for a, b in ranges[rank] if b > a]
        size = sum(t.numel() for t in self.mine)
        self.received: list[torch.Tensor] = []
        ops = []
        for k in range(1, ranks):  # peer by peer, in the same rotation on every rank
            to, src = (rank + k) % ranks, (rank - k) % ranks
            peer_to = dist.get_global_rank(group, to) if group else to
            peer_src = dist.get_global_rank(group, src) if group else src
            ops += [dist.P2POp(dist.isend, flat[a:b], peer_to, group)
                    for a, b in ranges[to] if b > a]
            buffer = flat.new_empty(size)
            self.received.append(buffer)
            ops += [dist.P2POp(dist.irecv, part, peer_src, group)
                    for part in buffer.split([t.numel() for t in self.mine])]
        self.works = dist.batch_isend_irecv(ops) if ops else []

    def wait(self) -> bool:
        _wait(self.works)
        for buffer in self.received:
            for mine, part in zip(self.mine, buffer.split([t.numel() for t in self.mine]),
                                  strict=True):
                mine.add_(part)
        self.works, self.received = [], []
        return True


def _wait(works: Sequence[dist.Work]) -> None:
    for work in works:
        work.wait()


class _HostAlloc:
    """FSDP2's comm protocol (``torch.distributed.fsdp``'s ``Comm``, whose classes are not
    exported): where the collective's buffer comes from."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class GlooAllGather(_HostAlloc):
    """FSDP2's all-gather on a gloo group: :func:`broadcast_chunks`."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> None:
        _wait(broadcast_chunks(output_tensor, input_tensor, group))


class GlooReduceScatter(_HostAlloc):
    """FSDP2's reduce-scatter on a gloo group: :func:`reduce_chunks`."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: dist.ReduceOp,
                 async_op: bool = False) -> None:
        reduce_chunks(output_tensor, input_tensor, group, op)
