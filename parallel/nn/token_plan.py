"""Which token-choices each expert takes, agreed by every rank that holds part of the batch.

Capacity is counted over the *global* batch, so an expert-parallel MoE drops exactly the choices a
single-device MoE would drop on the concatenated batch: priority runs choice-major (all first
choices before any second one), then by data rank, then by copy (token range, see
``MoE.copies``), then by token. One ``all_gather`` of each rank's choice counts ``[k, copies, E]``
gives every rank the whole table; from it each rank derives its own keep mask and *every* rank's
kept counts, which are the split sizes of the all-to-all exchanges (so dropless mode needs no
second count exchange, and capacity mode sends only kept rows rather than padding to capacity).

The exchanges take their split sizes as host integers, so the table must reach the host: it does
once per layer, as one small copy, and everything derived from it (the token total, capacity,
each rank's kept counts, the dropped count) is computed there; only this rank's keep mask is
computed where the choices are, from the queue ahead of them copied back without waiting. On an
accelerator every other read of a device value would be one more drain of its stream.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

import foundation.device as hd
from parallel.collectives import all_gather
from parallel.nn.router import capacity, keep_within_capacity


def copy_bounds(tokens: int, copies: int) -> list[tuple[int, int]]:
    """``copies`` contiguous token ranges, sizes differing by at most one (earlier ones larger)."""
    sizes = [tokens // copies + (c < tokens % copies) for c in range(copies)]
    starts = [sum(sizes[:c]) for c in range(copies)]
    return [(s, s + n) for s, n in zip(starts, sizes, strict=True)]


@dataclasses.dataclass
class TokenPlan:
    """``kept [tokens, k]``: this rank's choices within capacity; ``kept_counts[r][c][e]``: kept
    choices of data rank ``r``'s copy ``c`` at expert ``e``; ``load``: choices per expert over
    the global batch before dropping; ``tokens``/``dropped``: global totals."""

    kept: torch.Tensor
    kept_counts: list[list[list[int]]]
    load: torch.Tensor
    tokens: int
    dropped: int


def plan_tokens(experts: torch.Tensor, num_experts: int, capacity_factor: float | None,
                copies: int = 1, group: dist.ProcessGroup | None = None,
                rank: int = 0) -> TokenPlan:
    """The plan for this rank's ``experts [tokens, k]`` choices; ``group`` holds the batch's
    data ranks (None: this rank holds the whole batch), ``rank`` is this rank's index in it.
    ``capacity_factor=None`` keeps every choice (dropless)."""
    k = experts.shape[1]
    bounds = copy_bounds(experts.shape[0], copies)
    mine = torch.stack([F.one_hot(experts[lo:hi], num_experts).sum(0) for lo, hi in bounds],
                       dim=1)  # [k, copies, E]
    with torch.no_grad():
        everyone = mine.unsqueeze(0) if group is None else all_gather(mine.unsqueeze(0),
                                                                      group=group)
    table = hd.copy_to(everyone, torch.device("cpu"))  # the layer's one read (module docstring)
    queue = table.permute(1, 0, 2, 3)  # [k, ranks, copies, E]: the priority order
    flat = queue.reshape(-1, num_experts)
    ahead = (flat.cumsum(0) - flat).reshape(queue.shape)
    tokens = int(table[:, 0].sum())  # every token has exactly one first choice
    if capacity_factor is None:
        kept_queue, kept = queue, torch.ones_like(experts, dtype=torch.bool)
    else:
        cap = capacity(tokens, k, num_experts, capacity_factor)
        kept_queue = torch.minimum((cap - ahead).clamp(min=0), queue)
        mine_ahead = hd.copy_to(ahead[:, rank].contiguous(), experts.device)  # [k, copies, E]
        kept = torch.cat([keep_within_capacity(experts[lo:hi], num_experts, cap,
                                               mine_ahead[:, c])
                          for c, (lo, hi) in enumerate(bounds)])
    kept_counts = kept_queue.sum(0)  # [ranks, copies, E]
    return TokenPlan(kept=kept, kept_counts=kept_counts.tolist(),
                     load=everyone.sum((0, 1, 2)), tokens=tokens,
                     dropped=tokens * k - int(kept_counts.sum()))
