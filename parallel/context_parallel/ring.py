"""Ring attention (pass-KV): each rank keeps its queries and passes its keys and values around
the ring of context-parallel ranks, merging one block's attention per step.

Forward, ``c`` steps: rank ``r`` starts sending the key/value block it holds to rank ``r+1`` (and
receiving rank ``r-1``'s) before it attends to it, so the exchange runs behind the block's
compute; the partial results merge by their log-sum-exp (``blocks.merge``). Backward, ``c`` steps:
the key/value blocks go round again, each with a gradient accumulator that every rank adds its
queries' share to; after ``c`` passes the accumulator is back at the block's owner, whole. What is
kept between forward and backward is the local ``q, k, v``, the output (the returned tensor
itself) and the log-sum-exp: nothing of another rank.

Under a causal mask, which query chunk sees which key chunk follows from the chunks' global
order (``layout.chunk_ids``): a chunk after the key chunk sees all of it, the same chunk sees a
triangle, an earlier one nothing — the block is skipped. In the balanced layout every rank then
computes the same number of block products at every step.

The exchange is ``torch.distributed``'s batched ``isend``/``irecv`` (``k`` and ``v`` as two
messages, so no stacked copy is made); torch's own ring attention
(``torch.distributed.tensor.experimental.context_parallel``) dispatches CUDA's fused kernels
only, so it cannot serve the host (gloo), NPUs (HCCL) or every attention call a model makes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from foundation.errors import collective_guard
from parallel.context_parallel import blocks
from parallel.context_parallel.layout import chunk_ids

Pairs = list[tuple[slice, slice, bool]]


def block_pairs(q_ids: tuple[int, ...], kv_ids: tuple[int, ...], size: int,
                causal: bool) -> Pairs:
    """``(query rows, key rows, causal)`` products for local queries of chunks ``q_ids`` against
    a key block of chunks ``kv_ids`` (each chunk ``size`` tokens); masked-out pairs omitted."""
    if not causal:
        return [(slice(None), slice(None), False)]
    pairs = []
    for a, qi in enumerate(q_ids):
        rows = slice(a * size, (a + 1) * size)
        before = sum(1 for ki in kv_ids if ki < qi)  # chunks ascend: the earlier ones lead
        if before:
            pairs.append((rows, slice(0, before * size), False))
        if before < len(kv_ids) and kv_ids[before] == qi:
            pairs.append((rows, slice(before * size, (before + 1) * size), True))
    return pairs


class _Ring:
    """The ring of one context-parallel group, seen from this rank."""

    def __init__(self, group: dist.ProcessGroup, balanced: bool) -> None:
        self.group, self.balanced = group, balanced
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def ids(self, step: int) -> tuple[int, ...]:
        """The chunks of the key block this rank holds at ``step`` (the owner is ``rank-step``)."""
        return chunk_ids((self.rank - step) % self.size, self.size, self.balanced)

    def start_pass(self, *tensors: torch.Tensor) -> tuple[list[torch.Tensor], list[Any]]:
        """Send ``tensors`` to the next rank and receive the previous rank's (in flight)."""
        received = [torch.empty_like(t, memory_format=torch.contiguous_format)
                    for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        with collective_guard("ring attention's key/value pass", self.group):
            works = dist.batch_isend_irecv(ops)
        return received, works

    def finish(self, works: list[Any]) -> None:
        with collective_guard("ring attention's key/value pass", self.group):
            for work in works:
                work.wait()


class RingAttention(torch.autograd.Function):
    """``attention(q, k, v)`` over the sequence split across ``group`` (see the module doc);
    inputs ``[batch, heads, local tokens, head dim]``, ``k``/``v`` with a divisor of the heads."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                group: dist.ProcessGroup, causal: bool, scale: float, balanced: bool
                ) -> torch.Tensor:
        ring = _Ring(group, balanced)
        mine = ring.ids(0)
        size = q.shape[-2] // len(mine)
        acc = blocks.acc_dtype(q.dtype)
        # laid out [..., tokens, heads, dim] as the fused kernels lay theirs: the caller's
        # transpose(-3, -2).reshape back to the model width is then a view, not a second copy
        *batch, heads, tokens, dim = q.shape
        out = torch.zeros(*batch, tokens, heads, dim, dtype=acc,
                          device=q.device).transpose(-3, -2)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = [k, v]  # two messages, not one stacked copy: the pass's only buffers are received
        for step in range(ring.size):
            flight = ring.start_pass(*kv) if step < ring.size - 1 else None
            for rows, keys, tri in block_pairs(mine, ring.ids(step), size, causal):
                part, part_lse = blocks.attend(q[..., rows, :], kv[0][..., keys, :],
                                               kv[1][..., keys, :], scale, tri)
                out[..., rows, :], lse[..., rows] = blocks.merge(
                    out[..., rows, :], lse[..., rows], part, part_lse)
            if flight is not None:
                ring.finish(flight[1])
                kv = flight[0]
        result = out.to(q.dtype)  # kept for backward as FlashAttention keeps it: as returned
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.ring, ctx.causal, ctx.scale = ring, causal, scale
        return result

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring: _Ring = ctx.ring
        mine = ring.ids(0)
        size = q.shape[-2] // len(mine)
        acc = lse.dtype
        delta = (dout.to(acc) * out.to(acc)).sum(-1)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = [k, v]
        dkv = torch.zeros((2, *k.shape), dtype=acc, device=q.device)
        for step in range(ring.size):
            flight = ring.start_pass(*kv) if step < ring.size - 1 else None
            for rows, keys, tri in block_pairs(mine, ring.ids(step), size, ctx.causal):
                dq_part, dk_part, dv_part = blocks.attend_backward(
                    dout[..., rows, :], q[..., rows, :], kv[0][..., keys, :],
                    kv[1][..., keys, :], out[..., rows, :], delta[..., rows], lse[..., rows],
                    ctx.scale, tri)
                dq[..., rows, :] += dq_part
                dkv[0][..., keys, :] += dk_part
                dkv[1][..., keys, :] += dv_part
            # the accumulator follows its block; after the last step it comes home, whole
            grads, works = ring.start_pass(dkv) if ring.size > 1 else ([dkv], [])
            ring.finish(works + (flight[1] if flight is not None else []))
            dkv = grads[0]
            if flight is not None:
                kv = flight[0]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   group: dist.ProcessGroup, *, causal: bool = True, scale: float | None = None,
                   balanced: bool = True) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence split across ``group``'s ranks
    (``layout``: ``balanced`` is the head-tail chunk order). Inputs and output
    ``[batch, heads, local tokens, head dim]``; ``k``/``v`` may have fewer heads (a divisor)."""
    if q.shape[-3] % k.shape[-3] or k.shape != v.shape:
        raise ValueError(f"ring attention: key/value shapes {tuple(k.shape)}, {tuple(v.shape)} "
                         f"must be equal, with a number of heads dividing the queries' "
                         f"{q.shape[-3]}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return RingAttention.apply(q, k, v, group, causal, scale, balanced)
