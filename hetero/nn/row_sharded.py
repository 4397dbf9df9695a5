"""The parameter server's pull and push: a table whose rows are split across the ranks' host
memory, looked up and updated over ``torch.distributed`` all-to-all.

Rows are split in contiguous blocks, as ``torch.chunk`` (and DTensor's ``Shard(0)``) split them:
rank r holds rows ``[r * B, min((r + 1) * B, V))`` with ``B = ceil(V / N)``. Why blocks and not a
modulo split: CTR ids are hashed, so hot rows are already scattered over the blocks, and a block
is a ``Shard(0)`` DTensor that DCP re-shards to another world size by itself.

Pull (forward), the reference's heterogeneous Pull: the batch's ids are de-duplicated; their
counts per owner are exchanged first (all-to-all of N integers, which also carries a "bad ids"
flag so that an out-of-range id fails on every rank instead of leaving the others waiting); the
ids go to their owners (all-to-all with those splits); each owner gathers its rows; the rows come
back (all-to-all, reversed splits). Push (backward): the gradient of each distinct row goes back
to its owner by the reversed all-to-all and is coalesced there into a row-sparse gradient of the
owner's block, which ``hetero.optim.LazyAdam`` / ``FTRL`` apply to just those rows.

Why by hand: torch has no row-wise sharded table for the host over gloo (TorchRec's needs its own
kernels and no FTRL/LazyAdam), and ``torch.distributed.rpc`` is in maintenance mode.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

import foundation.device as hd
from foundation.collective_check import check as check_collective
from foundation.collective_check import check_splits
from foundation.errors import collective_guard
from hetero.nn.row_blocks import block, rows_per_rank
from hetero.nn.row_cache import CachedRows, RowCache
from hetero.placement.transfer import to_device

HOST = torch.device("cpu")


@dataclasses.dataclass
class Exchange:
    """Who asks whom for which rows, for one lookup."""

    inverse: torch.Tensor  # position of each looked-up id among the distinct ones
    sent: list[int]  # distinct ids this rank asks each owner for
    received: list[int]  # ids each peer asks this rank for
    requested: torch.Tensor  # this rank's local row numbers the peers asked for, peer by peer
    distinct: int


def plan_exchange(indices: torch.Tensor, vocab_size: int,
                  group: dist.ProcessGroup | None) -> Exchange:
    """De-duplicate ``indices`` and agree with every rank on the row exchange (collective)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    flat = hd.copy_to(indices.reshape(-1), HOST).to(torch.int64)
    distinct, inverse = torch.unique(flat, sorted=True, return_inverse=True)
    bad = distinct.numel() and (int(distinct[0]) < 0 or int(distinct[-1]) >= vocab_size)
    counts = torch.bincount(distinct.clamp(0, vocab_size - 1) // rows_per_rank(vocab_size, world),
                            minlength=world)
    if bad:
        counts.fill_(-1)
    received = torch.empty_like(counts)
    check_collective("all_to_all", counts, group, what="row id counts")
    dist.all_to_all_single(received, counts, group=group)
    if bad:
        first = int(distinct[0]) if int(distinct[0]) < 0 else int(distinct[-1])
        raise IndexError(f"EmbeddingLookup(sharding='row'): index {first} is out of range for "
                         f"vocab_size {vocab_size} (valid indices are 0 .. {vocab_size - 1})")
    if (received < 0).any():
        ranks = (received < 0).nonzero().flatten().tolist()
        raise IndexError(f"EmbeddingLookup(sharding='row'): rank(s) {ranks} looked up indices "
                         f"outside 0 .. {vocab_size - 1} (vocab_size {vocab_size}); see their "
                         f"errors")
    sent, got = counts.tolist(), received.tolist()
    requested = torch.empty(sum(got), dtype=torch.int64)
    check_collective("all_to_all_rows", distinct, group, what="row ids", free_dims=(0,))
    check_splits("all_to_all_rows", sent, got, group, what="row ids")
    dist.all_to_all_single(requested, distinct, got, sent, group=group)
    start, _ = block(vocab_size, world, rank)
    return Exchange(inverse, sent, got, requested - start, distinct.numel())


class Pull(torch.autograd.Function):
    """Rows of the distinct ids from their owners; backward pushes their gradients back."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, ex: Exchange, group: dist.ProcessGroup | None,
                grad_scale: float, output_device: torch.device | None = None) -> torch.Tensor:
        # rows bound for an accelerator are received into pinned memory: their copy there is
        # then a direct, non-blocking DMA rather than a staged copy from pageable memory
        pinned = shard.device.type == "cpu" and output_device is not None \
            and output_device.type != "cpu"
        rows = hd.pinned_empty((ex.distinct, shard.shape[1]), shard.dtype) if pinned \
            else shard.new_empty((ex.distinct, shard.shape[1]))
        with collective_guard("EmbeddingLookup(sharding='row') pull all_to_all", group):
            check_collective("all_to_all_rows", rows, group, what="row pull", free_dims=(0,))
            dist.all_to_all_single(rows, shard.index_select(0, ex.requested.to(shard.device)),
                                   ex.sent, ex.received, group=group)
        ctx.ex, ctx.group, ctx.grad_scale, ctx.shape = ex, group, grad_scale, shard.shape
        ctx.device = shard.device
        return rows

    @staticmethod
    def backward(ctx: Any, grad_rows: torch.Tensor) -> tuple:
        ex = ctx.ex  # the rows travel where the table lives: gloo on the host, NCCL/HCCL there
        grad_rows = hd.copy_to(grad_rows, ctx.device).contiguous()
        if ctx.grad_scale != 1.0:
            grad_rows = grad_rows * ctx.grad_scale
        back = grad_rows.new_empty((len(ex.requested), grad_rows.shape[1]))
        with collective_guard("EmbeddingLookup(sharding='row') push all_to_all", ctx.group):
            check_collective("all_to_all_rows", back, ctx.group, what="row push",
                             free_dims=(0,))
            dist.all_to_all_single(back, grad_rows, ex.received, ex.sent, group=ctx.group)
        if not hd.has_sparse_tensors(ctx.device):  # an NPU: the block's gradient, dense
            dense = back.new_zeros(ctx.shape).index_add_(0, ex.requested.to(ctx.device), back)
            return dense, None, None, None, None
        rows, where = torch.unique(ex.requested.to(ctx.device), sorted=True, return_inverse=True)
        summed = back.new_zeros((rows.numel(), back.shape[1])).index_add_(0, where, back)
        grad = torch.sparse_coo_tensor(rows.unsqueeze(0), summed, ctx.shape, is_coalesced=True,
                                       check_invariants=False)
        return grad, None, None, None, None


def sharded_lookup(shard: torch.Tensor, indices: torch.Tensor, vocab_size: int,
                   group: dist.ProcessGroup | None, grad_scale: float,
                   output_device: torch.device, cache: RowCache | None = None) -> torch.Tensor:
    """``table[indices]`` of the row-sharded table (collective: every rank calls it); with a
    ``cache``, its rows are served from it and only the others are pulled."""
    if torch.compiler.is_exporting():
        raise RuntimeError("EmbeddingLookup(sharding='row') cannot be captured (hetero.place, "
                           "torch.export): its lookup is a collective whose sizes depend on the "
                           "ids. Leave the model unplaced; the table already stays in host "
                           "memory and ships only the rows it looks up")
    if cache is None:
        with collective_guard("EmbeddingLookup(sharding='row') id exchange", group):
            ex = plan_exchange(indices, vocab_size, group)
        rows = to_device(Pull.apply(shard, ex, group, grad_scale, output_device), output_device)
        out = torch.nn.functional.embedding(to_device(ex.inverse, output_device), rows)
        return out.view(*indices.shape, shard.shape[1])
    flat = hd.copy_to(indices.reshape(-1), HOST).to(torch.int64)
    distinct, inverse = torch.unique(flat, sorted=True, return_inverse=True)
    slots = cache.slots(distinct)
    hit = slots >= 0
    with collective_guard("EmbeddingLookup(sharding='row') id exchange", group):
        ex = plan_exchange(distinct[~hit], vocab_size, group)  # bad ids are misses: named here
    cache.count(int(hit.sum()), distinct.numel(), ex.requested)
    pulled = to_device(Pull.apply(shard, ex, group, grad_scale, output_device), output_device)
    cached = CachedRows.apply(cache.rows, slots[hit], cache, grad_scale).to(output_device)
    # every rank runs both backward collectives, whatever it hit or missed
    order = torch.cat([torch.nonzero(hit).flatten(), torch.nonzero(~hit).flatten()])
    rows = torch.cat([cached, pulled]).index_select(0, torch.argsort(order).to(output_device))
    out = torch.nn.functional.embedding(inverse.to(output_device), rows)
    return out.view(*indices.shape, shard.shape[1])


def as_global(block_: torch.Tensor, vocab_size: int,
              group: dist.ProcessGroup | None) -> DTensor:
    """This rank's block as the whole table: a ``Shard(0)`` DTensor over ``group`` sharing the
    block's memory, so DCP saves each rank's rows once and loads (and re-shards) in place."""
    mesh = DeviceMesh.from_group(group or dist.group.WORLD, block_.device.type)
    shape = (vocab_size, *block_.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(block_, mesh, [Shard(0)], run_check=False, shape=shape,
                              stride=stride)


def as_block(value: torch.Tensor) -> torch.Tensor:
    """A state-dict entry back as this rank's block (a DTensor's local part)."""
    return value.to_local() if isinstance(value, DTensor) else value
