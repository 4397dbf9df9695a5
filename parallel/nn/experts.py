"""The experts of an MoE layer as stacked weights: ``w1 [E, d_model, d_ff]`` and
``w2 [E, d_ff, d_model]`` (one tensor each, so expert parallel shards them as ``Shard(0)``
DTensors over the ``ep`` ranks, and host placement moves them as one module).

Host experts: ``hetero.set_device(moe.experts, "cpu")`` keeps the stacked weights in host memory
through ``model.to(device)`` (as a host ``EmbeddingLookup`` keeps its table); only the routed
token rows cross to the host and their results back. The tag is read on every move, so it may be
set before or after the model is built.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import foundation.device as hd
from foundation.host_storage import stay_on_host
from hetero.tags import set_device_tag


def local_part(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a stacked weight (all of them unless sharded over ``ep``)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def padded_slots(counts: list[int], width: int) -> torch.Tensor:
    """Where each of the ``sum(counts)`` expert-sorted rows sits in an ``[E * width]`` block that
    gives every expert ``width`` rows: row ``j`` of expert ``e`` at ``e * width + j``."""
    sizes = torch.tensor(counts, dtype=torch.int64)
    starts = torch.cumsum(sizes, 0) - sizes
    expert = torch.repeat_interleave(torch.arange(len(counts)), sizes)
    return expert * width + torch.arange(int(sizes.sum())) - starts[expert]


def block_slots(blocks: list[list[int]], width: int) -> torch.Tensor:
    """Where each row of a peer-major arrival sits in the ``[E * width]`` block: ``blocks[q][l]``
    rows from peer ``q`` for local expert ``l``, in that order (q-major); expert ``l``'s rows keep
    peer order inside its block (so the result is :func:`padded_slots` of the expert-major
    rows, reached without regrouping them first)."""
    sizes = torch.tensor(blocks, dtype=torch.int64)  # [peers, experts]
    before = torch.cumsum(sizes, 0) - sizes  # rows of expert l from earlier peers
    starts = (torch.arange(sizes.shape[1]) * width + before).reshape(-1)  # q-major
    lengths = sizes.reshape(-1)
    block = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    first = torch.cumsum(lengths, 0) - lengths
    return starts[block] + torch.arange(int(lengths.sum())) - first[block]


class GroupedExperts(nn.Module):
    """``E`` two-layer GELU MLPs applied to tokens already grouped by expert."""

    #: hybrid placement leaves this module to itself: its host tag is honoured here, not by an
    #: fx split of the model (routing has data-dependent shapes no capture can follow)
    places_itself = True

    def __init__(self, d_model: int, d_ff: int, num_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, d_model, d_ff))
        self.w2 = nn.Parameter(torch.empty(num_experts, d_ff, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's default init, per expert (also what deferred initialization runs)."""
        with torch.no_grad():
            for w in (self.w1, self.w2):
                bound = 1 / math.sqrt(w.shape[1])
                nn.init.uniform_(w, -bound, bound)

    @property
    def on_host(self) -> bool:
        return set_device_tag(self) == "cpu"

    def forward(self, tokens: torch.Tensor, counts: list[int],
                blocks: list[list[int]] | None = None) -> torch.Tensor:
        """``tokens`` sorted by this rank's experts, ``counts[e]`` of them for local expert
        ``e``; computed where the weights are and returned on the tokens' device. With
        ``blocks`` (an expert-parallel arrival, :func:`block_slots`) the tokens are in peer-major
        order instead and the output comes back in the same order: the padded block is filled
        and read in that order directly, with no regrouping copy either way.

        All experts run in two batched matmuls (``torch.bmm`` over a ``[E, C, d]`` block, ``C``
        the largest count, shorter experts padded with zero rows), not a Python loop of two
        matmuls per expert: one kernel launch per layer of the MLP on a device, whatever ``E``.
        A padded row only meets zeros, so the result and the weights' gradients are the loop's;
        the padding is bounded by the router's capacity (every count is at most it). On the
        host the block goes through in slices of its rows, each hidden activation at most
        ``foundation.device.HOST_REUSED_BLOCK_BYTES`` (a slice's rows meet the same weights, so
        the results are the whole block's).
        """
        w1, w2 = local_part(self.w1), local_part(self.w2)
        rows = tokens.to(w1.device)
        experts, width = w1.shape[0], max(counts, default=0)
        if len(counts) != experts:
            raise ValueError(f"GroupedExperts: {len(counts)} counts for {experts} local experts")
        if width == 0:
            # no rows for any local expert: still an (empty) function of the rows and weights,
            # so backward runs the exchanges' reverse all-to-alls here as on the peers (not
            # skipping them, which would leave the peers waiting)
            return (F.gelu(rows @ w1[0]) @ w2[0]).to(tokens.device)
        slots = block_slots(blocks, width) if blocks is not None else padded_slots(counts, width)
        slots = hd.copy_to(slots, rows.device)
        block = rows.new_zeros(experts * width, rows.shape[1]).index_copy(0, slots, rows)
        block = block.view(experts, width, -1)
        # on the host, in slices of the padded rows small enough that every hidden activation
        # (and its gradient) comes from memory the allocator reuses (hd.rows_per_block: at
        # 2 x 4506 x 1024 floats, one GELU paid 17 ms of fresh page faults); one slice elsewhere
        step = hd.rows_per_block(experts * w1.shape[2] * rows.element_size(), rows.device)
        parts = [torch.bmm(F.gelu(torch.bmm(part, w1)), w2)
                 for part in (block.split(step, dim=1) if step else (block,))]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return out.reshape(experts * width, -1).index_select(0, slots).to(tokens.device)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
               ) -> GroupedExperts:
        """Device moves leave host experts on the host; dtype changes and host moves apply."""
        probe = fn(torch.empty(0))  # where, and in which dtype, fn puts a float32 tensor
        if not self.on_host or probe.device.type in ("cpu", "meta"):
            return super()._apply(fn, recurse)
        # to_empty of meta experts gives them host storage (foundation/host_storage.py)
        return super()._apply(lambda t: stay_on_host(t, probe.dtype), recurse)
