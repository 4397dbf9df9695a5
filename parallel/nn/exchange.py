"""Moving routed tokens to the ranks that hold their experts and the results back (expert
parallel's dispatch and combine).

The ``ep`` ranks of a group hold ``E / ep`` consecutive experts each. A rank sends its kept
token-choices, sorted by expert, with one variable-split all-to-all (rows for ep rank ``q`` are
those of ``q``'s experts); what arrives is peer-major (peer 0's rows for each of my experts, then
peer 1's, ...); the grouped experts place those rows straight into their padded expert blocks and
read the outputs back in the same order (``experts.block_slots``: no regrouping copy), which the
reverse all-to-all sends back. The split sizes come from the :class:`TokenPlan`'s kept
counts, which every rank already holds. Both exchanges are issued without waiting
(``wait=False``): the result waits on first use, so ``MoE.copies`` can overlap one copy's
exchange with another copy's expert compute.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from parallel.collectives import all_to_all_rows


@dataclasses.dataclass(frozen=True)
class ExpertGroups:
    """The process groups of an expert-parallel MoE: ``ep`` (ranks sharing out the experts)
    and ``batch`` (every rank holding part of the batch's tokens: ``dp × ep``, and ``× cp``
    when context parallel splits the sequences). This rank's ep peers are the batch ranks
    ``batch_rank + (q - ep_rank) * ep_stride`` for ``q`` in ``range(ep_size)``: contiguous
    (stride 1) in ``dp × ep``, ``cp`` apart in ``dp × ep × cp``."""

    ep: dist.ProcessGroup
    ep_size: int
    ep_rank: int
    batch: dist.ProcessGroup
    batch_size: int
    batch_rank: int
    ep_stride: int = 1

    @property
    def ep_peers(self) -> list[int]:
        """The batch ranks of this rank's ep group, in ep order."""
        first = self.batch_rank - self.ep_rank * self.ep_stride
        return [first + q * self.ep_stride for q in range(self.ep_size)]


@dataclasses.dataclass(frozen=True)
class Splits:
    """Row counts of one exchange, from this rank's point of view."""

    send: list[int]  # rows to each ep peer
    recv: list[int]  # rows from each ep peer
    blocks: list[list[int]]  # blocks[q][l]: rows from peer q for my local expert l

    @property
    def per_expert(self) -> list[int]:
        """Rows each of my local experts receives in all."""
        return [sum(col) for col in zip(*self.blocks, strict=True)]


def splits_for(kept: list[list[int]], groups: ExpertGroups) -> Splits:
    """``kept[r][e]``: kept rows of batch rank ``r`` for expert ``e`` (one copy)."""
    peers = [kept[r] for r in groups.ep_peers]
    local = len(kept[0]) // groups.ep_size
    me = groups.ep_rank

    def owned(row: list[int], q: int) -> list[int]:
        return row[q * local:(q + 1) * local]
    blocks = [owned(row, me) for row in peers]
    return Splits(send=[sum(owned(peers[me], q)) for q in range(groups.ep_size)],
                  recv=[sum(b) for b in blocks], blocks=blocks)


def dispatch(rows: torch.Tensor, splits: Splits, groups: ExpertGroups) -> torch.Tensor:
    """Issue the exchange of expert-sorted ``rows``; the result (peer-major) waits on use."""
    return all_to_all_rows(rows, splits.send, splits.recv, groups.ep, wait=False)


def combine(expert_out: torch.Tensor, splits: Splits, groups: ExpertGroups) -> torch.Tensor:
    """Issue the return of my experts' outputs (peer-major, as the rows arrived) to the peers
    that sent them."""
    return all_to_all_rows(expert_out, splits.recv, splits.send, groups.ep, wait=False)
