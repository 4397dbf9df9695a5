"""The GPT recipe with ``parallel.enable_parallel_optimizer``: the same losses as unsharded
``parallel=data`` on the same global batch, at every level, and a clear error where there are
no replicas."""

from __future__ import annotations

from pathlib import Path

import pytest

from recipe_helpers import compose_train, losses_of, run_recipe
from recipes import parallel_mode
from torch_features import needs_spmd_sharding

SHARD = ["parallel.enable_parallel_optimizer=true"]  # optimizer parallel, with a level


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory, cache) -> dict[int, float]:
    run = tmp_path_factory.mktemp("runs") / "unsharded"
    run_recipe(["trainer.max_steps=6", "parallel=data"], 2, run, cache)
    return losses_of(run)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("level", ["level1", "level2", "level3"])
def test_each_level_matches_unsharded_data_parallel(level, unsharded, tmp_path, cache):
    run = tmp_path / level
    run_recipe(["trainer.max_steps=6", "parallel=data", *SHARD,
                f"parallel.optimizer_level={level}",
                "parallel.parallel_optimizer_threshold=1"], 2, run, cache)
    losses = losses_of(run)
    assert sorted(losses) == sorted(unsharded)
    assert [losses[s] for s in sorted(losses)] == pytest.approx(
        [unsharded[s] for s in sorted(unsharded)], rel=1e-5)
    log = (run / "train.log").read_text()
    assert f"optimizer parallel {level} over dp_shard=2" in log
    assert "replicated in" in log


def test_parallel_optimizer_needs_data_parallel_replicas():
    cfg = compose_train([*SHARD, "parallel.optimizer_level=level2"])
    with pytest.raises(ValueError, match="data_degree=1: there is no replica to share"):
        parallel_mode.parallel_config(cfg.parallel, 1)
    cfg = compose_train(["parallel=data", *SHARD,
                         "parallel.optimizer_level=level2"])
    with pytest.raises(ValueError, match="data_degree=1: there is no replica to share"):
        parallel_mode.parallel_config(cfg.parallel, 1)
    cfg = compose_train(["parallel=semi_auto", "parallel.enable_parallel_optimizer=true"])
    with pytest.raises(ValueError, match="data_degree=1: there is no replica to share"):
        parallel_mode.parallel_config(cfg.parallel, 4)  # tp = every rank: no dp
    cfg = compose_train(["parallel=semi_auto", "parallel.tensor_degree=2",
                         *SHARD,
                         "parallel.optimizer_level=level3"])
    config = parallel_mode.parallel_config(cfg.parallel, 4)
    assert (config.data_degree, config.tensor_degree, config.optimizer_level) == (2, 2, "level3")
    config = parallel_mode.parallel_config(
        compose_train(["parallel=data", *SHARD,
                       "parallel.optimizer_level=level2"]).parallel, 4)
    assert (config.enable_parallel_optimizer, config.optimizer_level) == (True, "level2")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_offloaded_level2_matches_unsharded_offload(tmp_path, cache):
    """Each rank keeps its slice of the FP32 masters and moments on the host (bf16 weights):
    the losses follow the unsharded offloaded run up to bf16 rounding of the clipped update."""
    same = ["trainer.max_steps=6", "parallel=data", "offload=optimizer",
            "hetero.offload_kernel=torch"]
    plain, sharded = tmp_path / "plain", tmp_path / "sharded"
    run_recipe(same, 2, plain, cache)
    run_recipe([*same, *SHARD, "parallel.optimizer_level=level2",
                "parallel.parallel_optimizer_threshold=1"],
               2, sharded, cache)
    a, b = losses_of(plain), losses_of(sharded)
    assert a[1] == b[1]  # the same bf16 weights and data: the first loss is identical
    assert [b[s] for s in sorted(b)] == pytest.approx([a[s] for s in sorted(a)], rel=2e-2)
    assert "optimizer parallel level2 over dp_shard=2" in (sharded / "train.log").read_text()


@pytest.mark.slow
@pytest.mark.timeout(300)
@needs_spmd_sharding
def test_semi_auto_with_a_sharded_optimizer_matches_plain_semi_auto(tmp_path, cache):
    same = ["trainer.max_steps=6", "parallel=semi_auto", "parallel.tensor_degree=2"]
    plain, sharded = tmp_path / "plain", tmp_path / "sharded"
    run_recipe(same, 4, plain, cache, timeout=240)
    run_recipe([*same, *SHARD, "parallel.optimizer_level=level2",
                "parallel.parallel_optimizer_threshold=0"],
               4, sharded, cache, timeout=240)
    a, b = losses_of(plain), losses_of(sharded)
    assert [b[s] for s in sorted(b)] == pytest.approx([a[s] for s in sorted(a)], rel=1e-5)
    assert "optimizer parallel level2 over sa0=2" in (sharded / "train.log").read_text()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_sharded_checkpoint_resumes_at_another_degree_and_without_sharding(tmp_path, cache):
    """Saved by 2 ranks at level2; resumed by 4 ranks at level3 (pipeline × data, each stage's
    optimizer sharded) and by one plain process: steps 3 and 4 continue the same losses."""
    same = ["trainer.max_steps=4", "trainer.checkpoint_every=2", "model.n_layer=2",
            "parallel.parallel_optimizer_threshold=1"]
    first = tmp_path / "first"
    run_recipe([*same, "parallel=data", *SHARD,
                "parallel.optimizer_level=level2"], 2, first, cache)
    want = losses_of(first)
    checkpoint = f"trainer.resume_from={first / 'checkpoints' / 'step_000002'}"
    for name, args, nproc in (
            ("hybrid", ["parallel=hybrid", *SHARD, "parallel.optimizer_level=level3"], 4),
            ("plain", ["parallel=none"], None)):
        run_recipe([*same, *args, checkpoint], nproc, tmp_path / name, cache, timeout=240)
        again = losses_of(tmp_path / name)
        assert sorted(again) == [3, 4]
        assert [again[3], again[4]] == pytest.approx([want[3], want[4]], rel=1e-5), name
