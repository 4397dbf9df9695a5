"""A tied embedding/head table at level3, sharded by vocabulary rows and gathered only for the
head: the embedding lookup exchanges tokens, not weights.

FSDP2 lets one unit own a parameter, so a table shared by the token embedding (first module of
forward) and the output head (last) lands in the root unit, which stays gathered from the start
of forward to the end of backward, and its whole gradient lives from the head's backward to the
embedding's. With GPT-2's 50 k vocabulary that is two whole tables per rank on top of its 1/N
share: the largest thing a level3 rank holds (``benchmarks/memory_scale.py``).

Here the table is a ``Shard(0)`` DTensor over the data-parallel ranks that FSDP2 ignores:

* **embedding**: the ranks all-gather their token ids (a few KB), each looks up the ids that fall
  in its rows, and a reduce-scatter sums the rows back to the rank that asked (Megatron's
  vocab-parallel embedding, with the batch exchanged instead of split). Backward all-gathers the
  rows' gradients and each rank adds those of its own vocabulary rows. The table is never whole.
* **head**: the rows are all-gathered for ``logits = h Wᵀ`` and kept for the head's backward,
  which comes right after the loss; there the whole-table gradient is reduce-scattered at once.
  The whole table lives from the head's forward to its backward only.

The bytes moved per step equal FSDP2's for the table (one all-gather, one reduce-scatter), plus
the token exchange (tokens × d_model). Each rank's local gradient is the sum over every rank's
loss, divided by the data-parallel size when gradients are means, as FSDP2's are.

Written by hand because neither FSDP2 (one owner per parameter, no custom gather points) nor
DTensor (the lookup of a ``Shard(0)`` table all-gathers it) does this.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from foundation import device as hd
from foundation.compat import all_gather_single, reduce_scatter_single
from hetero.nn.row_blocks import mark_reduces_itself
from parallel.weights.deferred_spmd import empty_dtensor


def tied_tables(model: nn.Module) -> list[tuple[nn.Embedding, nn.Linear]]:
    """The (embedding, head) pairs of ``model`` that share one weight: a plain ``nn.Embedding``
    (no max_norm, dense gradients, no frequency scaling) and a bias-free ``nn.Linear``."""
    embeddings = {id(m.weight): m for m in model.modules()
                  if type(m) is nn.Embedding and m.max_norm is None and not m.sparse
                  and not m.scale_grad_by_freq}
    return [(embeddings[id(m.weight)], m) for m in model.modules()
            if type(m) is nn.Linear and m.bias is None and id(m.weight) in embeddings]


def shard_tied_tables(model: nn.Module, mesh: DeviceMesh, *, mean: bool, min_bytes: int = 0
                      ) -> list[nn.Parameter]:
    """Make each tied table of ``model`` of at least ``min_bytes`` (smaller ones stay
    replicated, as every parameter under the threshold) a ``Shard(0)`` DTensor over the 1-D
    ``mesh`` (local
    slicing of a whole table every rank holds, or an empty block of a meta one for deferred
    init to fill), its embedding a token-exchange lookup and its head a gathered projection;
    returns the new parameters (marked as reducing their own gradients)."""
    if mesh.ndim != 1:
        raise ValueError(f"shard_tied_tables: a 1-D data-parallel mesh is needed, got "
                         f"{mesh.ndim} dims")
    done = []
    for embedding, head in tied_tables(model):
        weight = embedding.weight
        if weight.numel() * weight.element_size() < min_bytes:
            continue
        table = (empty_dtensor(weight, mesh, [Shard(0)]) if weight.is_meta else
                 distribute_tensor(weight.detach(), mesh, [Shard(0)], src_data_rank=None))
        param = nn.Parameter(table, requires_grad=weight.requires_grad)
        mark_reduces_itself(param)
        embedding.weight = head.weight = param
        embedding.__class__, head.__class__ = VocabShardedEmbedding, VocabShardedHead
        embedding.mean = head.mean = mean
        done.append(param)
    return done


def _block(table: DTensor, mean: bool) -> tuple[int, int, dist.ProcessGroup, float]:
    """(first row of this rank's ``Shard(0)`` block, rows per rank before the last, the
    data-parallel group, the gradient scale: 1/N for mean gradients, as FSDP2's)."""
    mesh = table.device_mesh
    chunk = -(-table.shape[0] // mesh.size())
    group = mesh.get_group()
    scale = 1 / dist.get_world_size(group) if mean else 1.0
    return mesh.get_local_rank() * chunk, chunk, group, scale


def _gather_rows(local: torch.Tensor, chunk: int, rows: int, group: dist.ProcessGroup
                 ) -> torch.Tensor:
    """The whole table from every rank's block (blocks padded to ``chunk`` rows)."""
    size = dist.get_world_size(group)
    padded = F.pad(local, (0, 0, 0, chunk - local.shape[0])).contiguous()
    whole = local.new_empty(size * chunk, local.shape[1])
    all_gather_single(whole, padded, group=group)
    return whole[:rows]


class _ExchangedLookup(torch.autograd.Function):
    """Every rank's ids looked up in this rank's rows, summed back to their rank."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, ids: torch.Tensor, first: int,
                group: dist.ProcessGroup, scale: float, padding_idx: int | None
                ) -> torch.Tensor:
        size = dist.get_world_size(group)
        # the counts are host-known: exchanged on the host where the group has a backend there,
        # so reading the longest drains no device stream (else a fill, not a host copy)
        count = torch.full((1,), ids.numel(),
                           device="cpu" if hd.has_host_backend(group) else ids.device)
        counts = count.new_empty(size)
        all_gather_single(counts, count, group=group)
        longest = int(counts.max())
        flat = F.pad(ids.reshape(-1), (0, longest - ids.numel()), value=-1)
        every = flat.new_empty(size * longest)
        all_gather_single(every, flat, group=group)
        mine = (every >= first) & (every < first + local.shape[0])
        rows = torch.where(mine, every - first, 0)
        found = F.embedding(rows, local) * mine.unsqueeze(1).to(local.dtype)
        summed = found.new_empty(longest, local.shape[1])
        reduce_scatter_single(summed, found.contiguous(), group=group)
        if padding_idx is not None:  # its row's gradient stays zero, as nn.Embedding's
            mine &= every != padding_idx
        ctx.save_for_backward(rows, mine)
        ctx.meta = (local.shape, longest, ids.numel(), group, scale)
        return summed[:ids.numel()].reshape(*ids.shape, local.shape[1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows, mine = ctx.saved_tensors
        shape, longest, count, group, scale = ctx.meta
        size = dist.get_world_size(group)
        flat = F.pad(grad.reshape(count, shape[1]), (0, 0, 0, longest - count)).contiguous()
        every = flat.new_empty(size * longest, shape[1])
        all_gather_single(every, flat, group=group)
        local = every.new_zeros(shape)
        local.index_add_(0, rows[mine], every[mine])
        return local * scale, None, None, None, None, None


class _GatheredHead(torch.autograd.Function):
    """``h Wᵀ`` with W gathered from its row blocks and kept for the head's backward (right
    after the loss), whose whole-table gradient is reduce-scattered back to the blocks."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, local: torch.Tensor, chunk: int, rows: int,
                group: dist.ProcessGroup, scale: float) -> torch.Tensor:
        whole = _gather_rows(local, chunk, rows, group)
        ctx.save_for_backward(hidden, local)
        # not a saved tensor: backward drops it before the reduce-scatter, so the whole table
        # and its whole gradient are not held at once with the scatter's buffers
        ctx.whole = whole if torch.is_grad_enabled() else None
        ctx.meta = (chunk, rows, group, scale)
        return F.linear(hidden, whole.to(hidden.dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, local = ctx.saved_tensors
        chunk, rows, group, scale = ctx.meta
        whole, ctx.whole = ctx.whole, None  # gathered again by a second backward (retain_graph)
        if whole is None:
            whole = _gather_rows(local, chunk, rows, group)
        grad_hidden = (grad @ whole.to(grad.dtype)).to(hidden.dtype)
        del whole
        # the whole-table gradient, written into the reduce-scatter's padded input directly
        padded = local.new_empty(dist.get_world_size(group) * chunk, local.shape[1])
        padded[rows:].zero_()
        flat_grad = grad.reshape(-1, grad.shape[-1])
        flat_hidden = hidden.reshape(-1, hidden.shape[-1])
        if flat_grad.dtype == padded.dtype:
            torch.mm(flat_grad.t(), flat_hidden.to(flat_grad.dtype), out=padded[:rows])
        else:  # autocast: a 16-bit gradient, accumulated into the fp32 table's
            padded[:rows] = flat_grad.t().mm(flat_hidden.to(flat_grad.dtype))
        mine = local.new_empty(chunk, local.shape[1])
        reduce_scatter_single(mine, padded, group=group)
        del padded
        return grad_hidden, mine[:local.shape[0]] * scale, None, None, None, None


class VocabShardedEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose weight is a ``Shard(0)`` table: ids are exchanged, rows are
    not (module docstring)."""

    mean: bool

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        table: DTensor = self.weight
        first, _, group, scale = _block(table, self.mean)
        return _ExchangedLookup.apply(table.to_local(), ids, first, group, scale,
                                      self.padding_idx)


class VocabShardedHead(nn.Linear):
    """A bias-free ``nn.Linear`` whose weight is a ``Shard(0)`` table gathered for its forward
    and backward only (module docstring)."""

    mean: bool

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        table: DTensor = self.weight
        _, chunk, group, scale = _block(table, self.mean)
        return _GatheredHead.apply(hidden, table.to_local(), chunk, table.shape[0], group,
                                   scale)
