"""Collectives issued inside one backward from two threads (issue 39). On an accelerator the
autograd engine runs a host table's gradient push on the thread that called ``backward`` and its
device row cache's all-reduce on the device thread, beside the data-parallel reducer's buckets.
Here threads stand in for the engine's, started in opposite orders on the two ranks: each part
issues on a group of its own (``foundation.own_groups``), and every gradient equals the one
thread's backward. On one shared group the ranks' collectives met out of order."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import parallel
import parallel.dims
from distributed import run_ranks
from foundation.own_groups import own_group
from hetero.nn import EmbeddingLookup, row_cache, row_sharded
from parallel.data.grad_reducer import GradReducer

VOCAB, DIM = 40, 4


def _lookup_pieces(table: EmbeddingLookup, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The table's forward as it runs, with the outputs of its two backward-collective parts
    kept apart: the rows pulled from their owners and the rows served by the cache."""
    kept: dict[str, torch.Tensor] = {}
    pull, cached = row_sharded.Pull.apply, row_cache.CachedRows.apply

    def keep(name, apply):
        def run(*args):
            kept[name] = apply(*args)
            return kept[name]
        return run
    row_sharded.Pull.apply = keep("pulled", pull)
    row_cache.CachedRows.apply = keep("cached", cached)
    try:
        table(ids)
    finally:
        row_sharded.Pull.apply, row_cache.CachedRows.apply = pull, cached
    return kept


def _three_parts(rank: int, world: int) -> dict:
    parallel.init(timeout=30)
    torch.manual_seed(0)
    table = EmbeddingLookup(VOCAB, DIM, sharding="row", target="CPU", cache_size=6,
                            cache_refresh=1)
    dense = nn.Linear(DIM, 3)  # the data-parallel reducer's share, on the table's world group
    reducer = GradReducer(dense.parameters(), mean=True, cap_bytes=2**20, group=None)
    reducer.enabled = False  # run by hand below, as its hooks would from their thread
    gen = torch.Generator().manual_seed(rank)
    # one step first: the cache takes the hottest rows, so some lookups hit it
    table(torch.randint(0, 8, (12,), generator=gen)).sum().backward()
    torch.optim.SGD(table.parameters(), lr=0.1).step()
    pieces = _lookup_pieces(table, torch.randint(0, VOCAB, (10,), generator=gen))
    upstream = {name: torch.randn(t.shape, generator=gen) for name, t in pieces.items()}
    dense_grads = [torch.randn(p.shape, generator=gen) for p in dense.parameters()]

    def push() -> torch.Tensor:  # the host table's backward: its gradient push all_to_all
        return torch.autograd.grad(pieces["pulled"], table.weight, upstream["pulled"],
                                   retain_graph=True)[0].to_dense()

    def cache() -> torch.Tensor:  # the device cache's backward: two all_reduces
        return torch.autograd.grad(pieces["cached"], table.cache_rows, upstream["cached"],
                                   retain_graph=True)[0].to_dense()

    def buckets() -> list[torch.Tensor]:  # the reducer's bucket all_reduce
        for p, g in zip(dense.parameters(), dense_grads, strict=True):
            p.grad = g.clone()
        reducer.reduce_accumulated()
        return [p.grad.clone() for p in dense.parameters()]

    parts = {"push": push, "cache": cache, "buckets": buckets}
    want = {name: part() for name, part in parts.items()}  # one thread, one order
    got: dict = {}
    errors: list[BaseException] = []

    def run(name: str, delay: float) -> None:
        time.sleep(delay)
        try:
            got[name] = parts[name]()
        except BaseException as error:  # reported below, not lost on the thread
            errors.append(error)
    order = list(parts) if rank == 0 else list(reversed(parts))  # opposite on the two ranks
    threads = [threading.Thread(target=run, args=(name, 0.3 * i))
               for i, name in enumerate(order)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    groups = {"table": table.exchange_group, "cache": table.cache.group, "reducer": reducer.group}
    return {"same": {name: _equal(got[name], want[name]) for name in parts},
            "distinct groups": len({id(g) for g in groups.values()}) == 3,
            "cache hits": int((table.cache.ids >= 0).sum())}


def _equal(a, b) -> bool:
    if isinstance(a, list):
        return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    return torch.equal(a, b)


@pytest.mark.slow
def test_backward_parts_on_two_threads_in_opposite_orders_give_the_one_thread_gradients():
    for result in run_ranks(_three_parts, 2, timeout=120):
        assert result["cache hits"] > 0
        assert result["distinct groups"]
        assert result["same"] == {"push": True, "cache": True, "buckets": True}


def _made_once(rank: int, world: int) -> dict:
    parallel.init()
    world_group = own_group(None, "a purpose")
    pairs = parallel.dims.ProcessGroups.get([0, 1]), parallel.dims.ProcessGroups.get([2, 3])
    mine = pairs[rank // 2]
    sub = own_group(mine, "a purpose")  # each rank with its own pair: both pairs made
    total = torch.ones(1)
    dist.all_reduce(total, group=sub)
    return {"again": own_group(None, "a purpose") is world_group,
            "other purpose": own_group(None, "another") is not world_group,
            "ranks": dist.get_process_group_ranks(sub), "sum": total.item(),
            "a new group": own_group(mine, "another") is not mine}


@pytest.mark.slow
def test_own_groups_are_made_once_per_purpose_and_rank_set_for_every_layout():
    for rank, result in enumerate(run_ranks(_made_once, 4, timeout=120)):
        assert result["again"] and result["other purpose"] and result["a new group"]
        assert result["ranks"] == ([0, 1] if rank < 2 else [2, 3])
        assert result["sum"] == 2.0


def test_one_process_keeps_its_group():
    assert own_group(None, "a purpose") is None  # no process group at all
