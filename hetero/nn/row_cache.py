"""The device-side cache of a row-sharded table (``EmbeddingLookup(sharding="row", cache_size=C)``):
the hottest ``C`` rows, held on every rank in the memory the lookup delivers to, so the common rows
neither cross the network nor the host-device link each step.

Exactness first: a cached row must train as it would in its owner's block. Every rank therefore
holds the *same* rows (replicated, like data-parallel weights): the gradient of a cached row is
summed over the ranks (an all-reduce of the ``C`` slots' lookup counts, so a row any rank touched
is updated and one no rank touched is not, as LazyAdam and FTRL require, then one of the
gradient rows of the slots some rank used) and every rank applies the identical sparse update
with the row's optimizer state, which is cached beside it. The rows and their state move between
the owners' blocks and the cache only at a refresh, every ``refresh`` optimizer steps:

* every owner keeps a count of the lookups of each of its rows, decayed by half at every refresh
  (it saw every miss: the ids the pull exchanged; the cached rows' lookups it learns from the
  lookup-count all-reduce) and proposes its ``C`` most used rows, one all-gather of
  ``C`` (id, count) pairs per rank (the global top ``C`` lie among them);
* all ranks rank the proposals alike, by count, then already-cached first, then id, and keep
  the top ``C``;
* an evicted row is written back, values and optimizer state, by its owner from its own replica
  (no communication); an admitted row's owner contributes it to one all-reduce that fills the
  freed slots on every rank.

Why a decayed frequency (LFU with ageing) and not a per-step LRU: a cache
replicated on every rank must admit a row on every rank at once, which costs a broadcast of the
row and its state. Admitting every miss, as an LRU does, would cost more than pulling it. At
checkpoint the cache is written back first (``flush``), so the blocks DCP saves are the table;
loading a table empties the cache (the blocks are the truth again) and the next refresh refills
it. Any optimizer that updates the cache parameter drives it (LazyAdam, FTRL, torch's SGD): torch's
global optimizer step post-hook finds it at its first step and binds it, and from then on its steps
count towards the refreshes.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from foundation.collective_check import check as check_collective
from foundation.errors import collective_guard
from foundation.own_groups import own_group
from hetero.nn.row_blocks import mark_reduces_itself

_CACHE_ATTR = "_hp_row_cache"  # on the cache parameter: its RowCache
#: how much of a row's lookup count carries over each refresh (older windows count less)
DECAY = 0.5
#: optimizer -> the caches whose rows it updates (found at its first step)
_BOUND: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[RowCache]] = (
    weakref.WeakKeyDictionary())


def _after_any_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    """torch calls this after every optimizer's step: the caches it updates count the step."""
    caches = _BOUND.get(optimizer)
    if caches is None:
        caches = [c for g in optimizer.param_groups for p in g["params"]
                  if (c := row_cache_of(p)) is not None]
        _BOUND[optimizer] = caches
        for cache in caches:
            cache.bind(optimizer)
    for cache in caches:
        cache.after_step()


register_optimizer_step_post_hook(_after_any_step)


def row_cache_of(param: torch.Tensor) -> RowCache | None:
    """The cache ``param`` holds the rows of (None for other parameters)."""
    ref = getattr(param, _CACHE_ATTR, None)
    return ref() if ref is not None else None


class RowCache:
    """Which rows the cache holds, the window's counts, and the moves at a refresh."""

    def __init__(self, rows: nn.Parameter, block: nn.Parameter, row_range: tuple[int, int],
                 group: dist.ProcessGroup | None, refresh: int) -> None:
        self.rows, self.block = rows, block
        self.start = row_range[0]
        # its backward all-reduce runs on the cache's device thread: a group of its own
        # (foundation/own_groups.py), never interleaved with the table's exchanges
        self.group = own_group(group, "EmbeddingLookup row cache")
        self.refresh = refresh
        size = rows.shape[0]
        self.ids = torch.full((size,), -1, dtype=torch.int64)  # global id per slot, -1: empty
        self.counts = torch.zeros(size, dtype=torch.float64)  # global lookups per slot (window)
        # this owner's rows: lookups, halved at every refresh
        self.requests = torch.zeros(block.shape[0], dtype=torch.float64)
        self.hits = self.lookups = 0  # this rank's, since the last refresh
        self.hit_rate = 0.0  # of the last window
        self.steps = 0
        self._optimizer: weakref.ref | None = None
        self._sorted: tuple[torch.Tensor, torch.Tensor] | None = None
        setattr(rows, _CACHE_ATTR, weakref.ref(self))
        mark_reduces_itself(rows)

    # ----------------------------------------------------------------- lookups
    def slots(self, distinct: torch.Tensor) -> torch.Tensor:
        """The slot of each of ``distinct`` (sorted ids), -1 for a miss."""
        if self._sorted is None:  # the held ids, sorted once per refresh
            order = torch.argsort(self.ids)
            self._sorted = (order, self.ids[order])
        order, held = self._sorted
        where = torch.searchsorted(held, distinct).clamp(max=held.numel() - 1)
        found = held[where] == distinct
        return torch.where(found, order[where], torch.full_like(where, -1))

    def count(self, hits: int, lookups: int, requested: torch.Tensor) -> None:
        """Record one lookup: this rank's hits and distinct ids, and the rows of this owner's
        block the peers asked for (local row numbers, one per request)."""
        self.hits += hits
        self.lookups += lookups
        self.requests.index_add_(0, requested, torch.ones_like(requested, dtype=torch.float64))

    # ----------------------------------------------------------------- optimizer
    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer`` updates the cache's rows (a newer one replaces an older: its state
        moves with the rows from now on), and it writes the cache back before it saves its
        state."""
        self._optimizer = weakref.ref(optimizer)
        optimizer.register_state_dict_pre_hook(lambda _: self.flush())

    def _states(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The row-aligned optimizer state of the cache and of the block (same keys; none
        before the optimizer's first step)."""
        optimizer = self._optimizer() if self._optimizer is not None else None
        if optimizer is None:
            return {}, {}
        cache = optimizer.state.get(self.rows, {})
        block = optimizer.state.get(self.block, {})
        keys = [k for k, v in cache.items() if isinstance(v, torch.Tensor)
                and v.shape == self.rows.shape and k in block]
        return {k: cache[k] for k in keys}, {k: block[k] for k in keys}

    def after_step(self) -> None:
        self.steps += 1
        if self.steps % self.refresh == 0:
            self.refill()

    # ----------------------------------------------------------------- moves
    @torch.no_grad()
    def flush(self) -> None:
        """Write every cached row this rank owns back to its block, with its optimizer state
        (the cache stays valid: both now agree)."""
        self._write_back(torch.arange(self.ids.numel()))

    def _write_back(self, slots: torch.Tensor) -> None:
        slots = slots[self.ids[slots] >= 0]
        local = self.ids[slots] - self.start
        mine = (local >= 0) & (local < self.block.shape[0])
        slots, local = slots[mine], local[mine]
        if not slots.numel():
            return
        # the slot and row numbers are host bookkeeping; index_copy_ wants its index on the
        # device of the tensor it writes (a device block or device optimizer state)
        self.block.data.index_copy_(0, local.to(self.block.device),
                                    self.rows.data[slots.to(self.rows.device)]
                                    .to(self.block.device))
        cache_state, block_state = self._states()
        for key, value in cache_state.items():
            target = block_state[key]
            target.index_copy_(0, local.to(target.device),
                               value[slots.to(value.device)].to(target.device))

    def clear(self) -> None:
        """Forget the cached rows (a table was loaded: the blocks hold the truth)."""
        self.ids.fill_(-1)
        self.counts.zero_()
        self._sorted = None

    @torch.no_grad()
    def refill(self) -> None:
        """A refresh (collective): keep the window's most used rows, write back the rest,
        bring the admitted ones in; see the module docstring."""
        size = self.ids.numel()
        local = self.ids - self.start
        mine = (self.ids >= 0) & (local >= 0) & (local < self.block.shape[0])
        self.requests.index_add_(0, local[mine], self.counts[mine])  # the hits of its rows
        top = torch.topk(self.requests, min(size, self.requests.numel()))
        proposed = torch.full((size,), -1, dtype=torch.int64)
        proposed_counts = torch.zeros(size, dtype=torch.float64)
        used = top.values > 0
        proposed[: int(used.sum())] = top.indices[used] + self.start
        proposed_counts[: int(used.sum())] = top.values[used]
        world = dist.get_world_size(self.group)
        ids = [torch.empty_like(proposed) for _ in range(world)]
        counts = [torch.empty_like(proposed_counts) for _ in range(world)]
        with collective_guard("EmbeddingLookup cache refresh all_gather", self.group):
            check_collective("all_gather", proposed, self.group, what="cache refresh ids")
            dist.all_gather(ids, proposed, group=self.group)
            dist.all_gather(counts, proposed_counts, group=self.group)
        chosen = _ranked(torch.cat(ids), torch.cat(counts), self.ids, size)
        leaving = torch.nonzero(~torch.isin(self.ids, chosen) & (self.ids >= 0)).flatten()
        self._write_back(leaving)
        free = torch.nonzero(~torch.isin(self.ids, chosen) | (self.ids < 0)).flatten()
        coming = chosen[~torch.isin(chosen, self.ids)]
        self._bring_in(free[: coming.numel()], coming)
        self.ids[free[coming.numel():]] = -1
        self._sorted = None
        self.counts.zero_()
        self.requests.mul_(DECAY)
        self.hit_rate = self.hits / self.lookups if self.lookups else 0.0
        self.hits = self.lookups = 0

    def _bring_in(self, slots: torch.Tensor, ids: torch.Tensor) -> None:
        """Rows ``ids`` (and their state) into ``slots`` on every rank: each owner contributes
        its rows to one all-reduce of zeros elsewhere."""
        cache_state, block_state = self._states()
        parts = [self.block.data, *block_state.values()]
        width = sum(p.shape[1] for p in parts)
        buffer = torch.zeros(ids.numel(), width, dtype=self.block.dtype)
        local = ids - self.start
        mine = (local >= 0) & (local < self.block.shape[0])
        if mine.any():
            rows = [p[local[mine].to(p.device)].to("cpu", self.block.dtype) for p in parts]
            buffer[mine] = torch.cat(rows, dim=1)
        with collective_guard("EmbeddingLookup cache refresh all_reduce", self.group):
            check_collective("all_reduce", buffer, self.group, what="cache refresh rows")
            dist.all_reduce(buffer, group=self.group)
        columns = torch.split(buffer, [p.shape[1] for p in parts], dim=1)
        targets = [self.rows.data, *cache_state.values()]
        for target, values in zip(targets, columns, strict=True):
            target.index_copy_(0, slots.to(target.device), values.to(target.device, target.dtype))
        self.ids[slots] = ids


def _ranked(proposed: torch.Tensor, counts: torch.Tensor, cached: torch.Tensor,
            size: int) -> torch.Tensor:
    """The ``size`` ids to hold, the same on every rank: by count, then already cached, then
    smaller id (``proposed`` holds -1 where an owner had fewer used rows)."""
    valid = proposed >= 0
    ids, counts = proposed[valid], counts[valid]
    held = torch.isin(ids, cached).to(torch.int64)
    order = torch.argsort(ids, stable=True)  # stable sorts, least significant key first
    for key in (-held, -counts):
        order = order[torch.argsort(key[order], stable=True)]
    return ids[order][:size]


class CachedRows(torch.autograd.Function):
    """Cached rows by slot; backward sums their gradients over the ranks (with a count column,
    so a row any rank looked up gets updated) into a row-sparse gradient of the cache."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, slots: torch.Tensor, cache: RowCache,
                grad_scale: float) -> torch.Tensor:
        ctx.slots, ctx.cache, ctx.grad_scale, ctx.shape = slots, cache, grad_scale, rows.shape
        return rows.index_select(0, slots.to(rows.device))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        cache, slots = ctx.cache, ctx.slots.to(grad.device)
        size, dim = ctx.shape
        # first the lookup counts of every slot (small), then the gradient rows of the slots
        # some rank used: a hot set larger than one step's lookups is not summed whole
        counts = grad.new_zeros(size).index_add_(0, slots, torch.ones_like(slots,
                                                                            dtype=grad.dtype))
        with collective_guard("EmbeddingLookup cache gradient all_reduce", cache.group):
            check_collective("all_reduce", counts, cache.group, what="cache gradient counts")
            dist.all_reduce(counts, group=cache.group)
            used = torch.nonzero(counts > 0).flatten()
            position = torch.full((size,), -1, dtype=torch.int64, device=grad.device)
            position[used] = torch.arange(used.numel(), device=grad.device)
            summed = grad.new_zeros((used.numel(), dim)).index_add_(0, position[slots], grad)
            check_collective("all_reduce", summed, cache.group, what="cache gradient rows")
            dist.all_reduce(summed, group=cache.group)
        cache.counts += counts.to("cpu", torch.float64)
        out = torch.sparse_coo_tensor(used.unsqueeze(0), summed * ctx.grad_scale, ctx.shape,
                                      is_coalesced=True, check_invariants=False)
        return out, None, None, None
