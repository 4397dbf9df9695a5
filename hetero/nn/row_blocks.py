"""Which rows of a row-sharded table a rank holds, and the mark a block parameter carries.

Dependency-free on purpose: ``parallel.data.DataParallel`` and the sparse optimizers read
the mark, and the lookup itself (``row_sharded.py``) needs ``parallel``'s collectives.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

_SHARD_ATTR = "_hp_row_shard"  # on a row-sharded parameter: (vocab_size, process group)
_SELF_REDUCED_ATTR = "_hp_reduces_itself"  # on a replicated parameter that sums its own grads
_STATE_MAKER_ATTR = "_hp_state_maker"  # on a table at rest in a file: makes its state beside it


def rows_per_rank(vocab_size: int, world: int) -> int:
    return math.ceil(vocab_size / world)


def block(vocab_size: int, world: int, rank: int) -> tuple[int, int]:
    """The rows ``[start, end)`` rank ``rank`` holds (``torch.chunk``'s split)."""
    size = rows_per_rank(vocab_size, world)
    return min(rank * size, vocab_size), min((rank + 1) * size, vocab_size)


def mark_row_shard(param: torch.Tensor, vocab_size: int, group: Any) -> None:
    """Record that ``param`` is one block of a ``vocab_size``-row table split over ``group``, so
    state dicts (the table's, and the sparse optimizers' state of it) present it whole, and data
    parallel leaves it alone (its gradients were already pushed to their owners)."""
    setattr(param, _SHARD_ATTR, (vocab_size, group))


def row_shard_of(param: torch.Tensor) -> tuple[int, Any] | None:
    return getattr(param, _SHARD_ATTR, None)


def mark_reduces_itself(param: torch.Tensor) -> None:
    """Record that ``param`` is replicated but its gradient is already summed over the ranks
    (a row cache's rows): data parallel must not reduce it again."""
    setattr(param, _SELF_REDUCED_ATTR, True)


def reduces_itself(param: torch.Tensor) -> bool:
    """A parameter data parallel leaves alone: a row-sharded table's block, or a parameter
    that reduces its own gradients."""
    return row_shard_of(param) is not None or getattr(param, _SELF_REDUCED_ATTR, False)


def mark_state_maker(param: torch.Tensor, make: Callable[[str], torch.Tensor]) -> None:
    """Record where ``param``'s optimizer state is made: ``make(name)`` returns a zero tensor
    of ``param``'s shape and dtype for the state called ``name`` (a table on disk has its state
    on disk beside it)."""
    setattr(param, _STATE_MAKER_ATTR, make)


def zeros_for_state(param: torch.Tensor, name: str) -> torch.Tensor:
    """A zero tensor like ``param`` for its optimizer state ``name``: where the table's mark
    says (:func:`mark_state_maker`), else in ``param``'s memory, as ``torch.zeros_like``."""
    make = getattr(param, _STATE_MAKER_ATTR, None)
    if make is None:
        return torch.zeros_like(param, memory_format=torch.preserve_format)
    return make(name)


def state_made_elsewhere(param: torch.Tensor) -> bool:
    """Whether ``param``'s optimizer state has its own place (:func:`mark_state_maker`)."""
    return getattr(param, _STATE_MAKER_ATTR, None) is not None
