"""``ShardedGradScaler``: fp16 loss scaling where gradients are DTensor shards and plain tensors
(optimizer parallel, experts, tensor parallel), the overflow agreed over the ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

import parallel
from distributed import run_ranks
from parallel.dims import build_mesh
from parallel.grad_scaler import ShardedGradScaler
from recipe_helpers import losses_of, run_recipe


def _mixed(world: int) -> tuple[nn.Parameter, nn.Parameter, torch.optim.Optimizer]:
    """A DTensor parameter sharded over the world and a plain one, with their gradients."""
    mesh = build_mesh((world,), ("dp",))
    sharded = nn.Parameter(distribute_tensor(torch.ones(4 * world, 2), mesh, [Shard(0)]))
    plain = nn.Parameter(torch.ones(3))
    sharded.grad = distribute_tensor(torch.full((4 * world, 2), 8.0), mesh, [Shard(0)])
    plain.grad = torch.full((3,), 8.0)
    return sharded, plain, torch.optim.SGD([sharded, plain], lr=0.5)


def test_the_plain_scaler_refuses_the_mix_and_this_one_unscales_it():
    parallel.init()
    try:
        *_, opt = _mixed(1)
        plain_scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        plain_scaler.scale(torch.ones(()))
        with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
            plain_scaler.unscale_(opt)
        sharded, plain, opt = _mixed(1)
        scaler = ShardedGradScaler("cpu", init_scale=4.0)
        scaler.scale(torch.ones(()))  # the loss it scaled: 4x
        scaler.unscale_(opt)
        assert torch.equal(sharded.grad.full_tensor(), torch.full((4, 2), 2.0))
        assert torch.equal(plain.grad, torch.full((3,), 2.0))
        scaler.step(opt)
        scaler.update()
        assert torch.equal(plain.detach(), torch.zeros(3)) and scaler.get_scale() == 4.0
    finally:
        parallel.destroy()


def _overflow_on_one_rank(rank: int, world: int) -> dict:
    parallel.init()
    sharded, plain, opt = _mixed(world)
    if rank == 1:  # only this rank's shard overflows
        sharded.grad.to_local()[0, 0] = float("inf")
    scaler = ShardedGradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    scaler.step(opt)
    scaler.update()
    return {"stepped": not torch.equal(plain.detach(), torch.ones(3)),
            "scale": scaler.get_scale()}


@pytest.mark.slow
def test_an_overflow_in_one_ranks_shard_skips_the_step_on_every_rank():
    for result in run_ranks(_overflow_on_one_rank, 2):
        assert result == {"stepped": False, "scale": 2.0}  # skipped, the scale backed off


@pytest.mark.slow
def test_fp16_recipe_with_sharded_gradients_trains_like_data_parallel(tmp_path):
    fp16 = ["trainer.precision=fp16", "trainer.max_steps=4"]
    run_recipe([*fp16, "parallel.enable_parallel_optimizer=true",
                "parallel.optimizer_level=level3"], 2, tmp_path / "level3", tmp_path / "data")
    run_recipe([*fp16, "parallel=data"], 2, tmp_path / "data_parallel", tmp_path / "data")
    got, want = losses_of(tmp_path / "level3"), losses_of(tmp_path / "data_parallel")
    assert sorted(got) == [1, 2, 3, 4]
    assert [got[s] for s in got] == pytest.approx([want[s] for s in got], rel=1e-4)
