"""gloo's all-gather and reduce-scatter as one broadcast / one reduce per rank's chunk, and
the exchange reduce-scatter over uneven ranges (``parallel.optimizer_parallel.chunkwise``): the
same results as torch's collectives, on the world and on a sub-group (whose ranks are not the
world's); what level3 uses on gloo: its own gathers (``resharded.py``) on a plain model, the
chunkwise collectives in FSDP2's units where it stays on FSDP2 (16-bit ``param_dtype``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import parallel
from distributed import fsdp_param_groups, run_ranks
from foundation import device as hd
from foundation.compat import all_gather_single, reduce_scatter_single
from parallel.optimizer_parallel.chunkwise import (
    GlooAllGather,
    RangeReduce,
    broadcast_chunks,
    chunkwise,
    reduce_chunks,
)


def _compare(group: dist.ProcessGroup | None) -> dict[str, Any]:
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = torch.arange(6, dtype=torch.float32) + 10 * dist.get_rank()
    want = torch.empty(6 * ranks)
    all_gather_single(want, mine, group=group)
    got = torch.full((6 * ranks,), float("nan"))
    for work in broadcast_chunks(got, mine, group):
        work.wait()
    grads = torch.randn(6 * ranks, generator=torch.Generator().manual_seed(dist.get_rank()))
    summed = torch.empty(6)
    reduce_scatter_single(summed, grads.clone(), group=group)
    scattered = torch.empty(6)
    reduce_chunks(scattered, grads.clone(), group)
    # uneven ranges, two per rank (a bucket of two parameters whose rows split unevenly); on 2
    # ranks the last four ranges belong to no one and must be left as they were
    ranges = [[(0, 3), (8, 9)], [(3, 5), (9, 10)], [(5, 7), (10, 11)], [(7, 8), (11, 12)]][:ranks]
    flat = grads[:12].clone()
    RangeReduce(flat, ranges, group).wait()
    total = grads[:12].clone()
    dist.all_reduce(total, group=group)
    owned = {i for part in ranges for a, b in part for i in range(a, b)}
    exact = all(torch.allclose(flat[a:b], total[a:b]) for a, b in ranges[rank])
    untouched = all(flat[i] == grads[i] for i in range(12) if i not in owned)
    return {"gather": torch.equal(got, want), "scatter": torch.allclose(scattered, summed),
            "exchange": exact and untouched, "rank": rank}


def _ranks(rank: int, world: int) -> dict[str, Any]:
    parallel.init()
    odd = dist.new_group([1, 3])
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    plain = parallel.optimizer_parallel.ShardedDataParallel(model, "level3", threshold_kb=0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    wrapped = parallel.optimizer_parallel.ShardedDataParallel(model, "level3", threshold_kb=0,
                                                              param_dtype=torch.bfloat16)
    comms = {type(fsdp_param_groups(m)[0]._all_gather_comm).__name__
             for m in wrapped.modules() if hasattr(m, "_get_fsdp_state")
             and fsdp_param_groups(m)}
    return {"world": _compare(None), "odd": _compare(odd) if rank % 2 else None,
            "comms": sorted(comms), "chunkwise": chunkwise(None, "cpu"),
            "plain": type(plain._whole).__name__,
            "plain_fsdp": any(hasattr(m, "_get_fsdp_state") for m in plain.modules())}


@pytest.mark.slow
def test_chunkwise_collectives_equal_torchs_and_level3_uses_them_on_gloo():
    for result in run_ranks(_ranks, 4, timeout=180):
        assert result["world"]["gather"] and result["world"]["scatter"]
        assert result["world"]["exchange"]
        if result["odd"] is not None:  # ranks 1 and 3: a group whose rank 0 is world rank 1
            assert result["odd"]["gather"] and result["odd"]["scatter"]
            assert result["odd"]["exchange"]
        assert result["chunkwise"] is hd.gathers_chunkwise("gloo") is True
        assert result["comms"] == [GlooAllGather.__name__]
        assert result["plain"] == "ReshardedWeights" and not result["plain_fsdp"]
