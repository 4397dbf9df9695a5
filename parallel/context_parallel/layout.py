"""Which tokens of the sequence each context-parallel rank holds, and their positions.

The sequence of ``T`` tokens is cut into chunks. Unbalanced (``balanced=False``): ``c`` chunks,
rank ``r`` holds chunk ``r``. Balanced (the default, Megatron-core's and torchtitan's
"zigzag"/head-tail layout): ``2c`` chunks, rank ``r`` holds chunks ``r`` and ``2c-1-r``. Under a
causal mask a token attends to the tokens before it, so the unbalanced layout gives the last rank
``2c-1`` times the first rank's work; in the balanced one every rank holds one early and one late
chunk and does the same work (``parallel.context_parallel.ring`` skips the masked halves).

A sequence length the chunks do not divide is refused by name: padding would add tokens the
loss and the attention of every rank would have to know about.
"""

from __future__ import annotations

import torch


def chunk_ids(rank: int, degree: int, balanced: bool = True) -> tuple[int, ...]:
    """The chunk indices ``rank`` holds, in the order they sit in its local sequence."""
    return (rank, 2 * degree - 1 - rank) if balanced and degree > 1 else (rank,)


def chunk_count(degree: int, balanced: bool = True) -> int:
    """How many chunks the sequence is cut into."""
    return 2 * degree if balanced and degree > 1 else degree


def check_length(length: int, degree: int, balanced: bool = True) -> int:
    """The length of one chunk; ValueError naming the rule when ``length`` does not divide."""
    chunks = chunk_count(degree, balanced)
    if length % chunks:
        layout = f"2 × context_degree = {chunks} chunks" if chunks != degree else (
            f"context_degree = {degree} chunks")
        raise ValueError(
            f"context parallel: the sequence length {length} does not divide into {layout} "
            f"(balanced={balanced}); use a sequence length that is a multiple of {chunks}")
    return length // chunks


def shard_sequence(x: torch.Tensor, rank: int, degree: int, dim: int = 1,
                   balanced: bool = True) -> torch.Tensor:
    """``rank``'s tokens of ``x`` along ``dim`` (its chunks, concatenated)."""
    size = check_length(x.shape[dim], degree, balanced)
    parts = [x.narrow(dim, i * size, size) for i in chunk_ids(rank, degree, balanced)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def positions(length: int, rank: int, degree: int, balanced: bool = True,
              device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions (``int64``) of ``rank``'s tokens of a ``length``-token sequence."""
    size = check_length(length, degree, balanced)
    return torch.cat([torch.arange(i * size, (i + 1) * size, device=device)
                      for i in chunk_ids(rank, degree, balanced)])


def unshard_order(degree: int, balanced: bool = True) -> list[int]:
    """For chunks gathered in rank order (each rank's chunks in its local order), the index of
    each chunk of the sequence in that gathered list: ``gathered[order[i]]`` is chunk ``i``."""
    gathered = [i for r in range(degree) for i in chunk_ids(r, degree, balanced)]
    return [gathered.index(i) for i in range(chunk_count(degree, balanced))]
