"""gloo's all-gather and reduce-scatter as one broadcast / one reduce per rank's chunk
(``parallel.optimizer_parallel.chunkwise``): the same results as torch's collectives, on the
world and on a sub-group (whose ranks are not the world's), and what level3's FSDP2 units use.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import parallel
from distributed import run_ranks
from foundation import device as hd
from parallel.optimizer_parallel.chunkwise import (
    GlooAllGather,
    broadcast_chunks,
    chunkwise,
    reduce_chunks,
)


def _compare(group: dist.ProcessGroup | None) -> dict[str, Any]:
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = torch.arange(6, dtype=torch.float32) + 10 * dist.get_rank()
    want = torch.empty(6 * ranks)
    dist.all_gather_single(want, mine, group=group)
    got = torch.full((6 * ranks,), float("nan"))
    for work in broadcast_chunks(got, mine, group):
        work.wait()
    grads = torch.randn(6 * ranks, generator=torch.Generator().manual_seed(dist.get_rank()))
    summed = torch.empty(6)
    dist.reduce_scatter_single(summed, grads.clone(), group=group)
    scattered = torch.empty(6)
    reduce_chunks(scattered, grads.clone(), group)
    return {"gather": torch.equal(got, want), "scatter": torch.allclose(scattered, summed),
            "rank": rank}


def _ranks(rank: int, world: int) -> dict[str, Any]:
    parallel.init()
    odd = dist.new_group([1, 3])
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    wrapped = parallel.ShardedDataParallel(model, "level3", threshold_kb=0)
    comms = {type(m._get_fsdp_state()._fsdp_param_groups[0]._all_gather_comm).__name__
             for m in wrapped.modules() if hasattr(m, "_get_fsdp_state")
             and m._get_fsdp_state()._fsdp_param_groups}
    return {"world": _compare(None), "odd": _compare(odd) if rank % 2 else None,
            "comms": sorted(comms), "chunkwise": chunkwise(None, "cpu")}


@pytest.mark.slow
def test_chunkwise_collectives_equal_torchs_and_level3_uses_them_on_gloo():
    for result in run_ranks(_ranks, 4, timeout=180):
        assert result["world"]["gather"] and result["world"]["scatter"]
        if result["odd"] is not None:  # ranks 1 and 3: a group whose rank 0 is world rank 1
            assert result["odd"]["gather"] and result["odd"]["scatter"]
        assert result["chunkwise"] is hd.gathers_chunkwise("gloo") is True
        assert result["comms"] == [GlooAllGather.__name__]
