"""The disk tier under optimizer parallel on 2 gloo ranks (one spawn): ``DiskAdamW`` over each
rank's shards (levels 1, 2 and 3) trains bit for bit like torch's fused AdamW over the same
shards, each rank's file holding its own rows only, and a DCP checkpoint written from the files
resumes into a fresh optimizer with the same steps."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

import parallel
from distributed import run_ranks
from hetero.offload import DiskAdamW
from parallel.optimizer_parallel import ShardedDataParallel
from pipeline_helpers import full_params, rank_steps, tiny_gpt

LEVELS = ("level1", "level2", "level3")
KW = dict(lr=1e-2, weight_decay=0.1)
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _level(rank: int, world: int, level: str, root: Path) -> dict:
    out = {}
    model = ShardedDataParallel(tiny_gpt(3), level, threshold_kb=0)
    opt = torch.optim.AdamW(model.parameters(), fused=True, **KW)
    out["torch"] = (rank_steps(model, opt, range(4), rank, world), full_params(model))

    directory = Path(tempfile.mkdtemp(dir=root))
    model = ShardedDataParallel(tiny_gpt(3), level, threshold_kb=0)
    opt = DiskAdamW(model.parameters(), path=directory, chunk_mb=0.05, **KW)
    losses = rank_steps(model, opt, range(2), rank, world)
    out["file bytes"] = sum(f.stat().st_size for f in directory.iterdir())
    out["local elements"] = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel()
                                for p in model.parameters())
    model_sd, optim_sd = get_state_dict(model, opt, options=FLAT)
    checkpoint = root / f"{level}.ckpt"
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint)
    opt.close()

    model = ShardedDataParallel(tiny_gpt(3), level, threshold_kb=0)  # a resumed run
    fresh = DiskAdamW(model.parameters(), path=directory, chunk_mb=0.05, **KW)
    model_sd, optim_sd = get_state_dict(model, fresh, options=FLAT)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint)
    set_state_dict(model, fresh, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=FLAT)
    losses += rank_steps(model, fresh, range(2, 4), rank, world)
    out["disk"] = (losses, full_params(model))
    fresh.close()
    return out


def _cases(rank: int, world: int) -> dict:
    parallel.init()
    root = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(root)  # one checkpoint directory for every rank
    out = {level: _level(rank, world, level, Path(root[0])) for level in LEVELS}
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root[0])
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_cases, 2, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
def test_disk_state_under_optimizer_parallel_trains_like_torch_adamw_bit_for_bit(
        two_ranks, level):
    for results in two_ranks:
        got, want = results[level]["disk"], results[level]["torch"]
        assert got[0] == want[0]  # the losses, across a checkpoint written from the files
        assert all(torch.equal(got[1][k], want[1][k]) for k in want[1])


@pytest.mark.slow
def test_each_rank_keeps_the_state_of_its_own_shards_only(two_ranks):
    for results in two_ranks:
        for level in LEVELS:
            local = results[level]["local elements"]
            assert local < sum(v.numel() for v in results[level]["torch"][1].values())
            # master and both moments of this rank's elements, rounded up to whole blocks
            assert 12 * local <= results[level]["file bytes"] < 12 * local + 2 * 3 * 4096 * 4
