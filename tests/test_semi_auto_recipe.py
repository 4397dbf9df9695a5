"""The GPT recipe with ``parallel=semi_auto``: 2 ranks under the Megatron strategy file train with
the losses of a single process, and bad settings fail before training."""

from __future__ import annotations

import pytest
from torch import nn

import parallel
from recipe_helpers import compose_train, losses_of, run_recipe
from recipes import parallel_mode


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_semi_auto_recipe_matches_one_process(tmp_path, default_recipe_single):
    single, cache, _ = default_recipe_single
    sharded = tmp_path / "semi_auto"
    proc = run_recipe(["trainer.max_steps=4", "parallel=semi_auto"], 2, sharded, cache)
    got, want = losses_of(sharded), losses_of(single)
    assert sorted(got) == [1, 2, 3, 4] and got[4] < got[1]
    assert [got[s] for s in range(1, 5)] == pytest.approx([want[s] for s in range(1, 5)],
                                                          rel=1e-5)
    log = (sharded / "train.log").read_text()
    assert "mesh pp=1 × dp=1 × ep=1 × cp=1 × tp=2 (operators: strategies)" in log
    assert "blocks.0.mlp.0.weight" in log and "(S(0))" in log  # column-parallel, 2 ranks
    # the log summarises the plan (sharded layouts only); the whole of it is in its own file
    plan = (sharded / "parallel_plan.txt").read_text()
    assert "blocks.0.ln1.weight" in plan and "blocks.0.ln1.weight" not in log
    assert "replicated parameters" in log and "parallel_plan.txt" in log
    assert (sharded / "checkpoints" / "step_000004" / ".metadata").is_file()
    assert "Training summary" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_semi_auto_recipe_with_the_dataset_strategy_matches_one_process(
        tmp_path, default_recipe_single):
    """parallel.full_batch=false: each of the 2 data-parallel ranks loads only its half."""
    single, cache, _ = default_recipe_single
    sliced = tmp_path / "sliced"
    run_recipe(["trainer.max_steps=4", "parallel=semi_auto", "parallel.tensor_degree=1",
                "parallel.full_batch=false"], 2, sliced, cache)
    got, want = losses_of(sliced), losses_of(single)
    assert [got[s] for s in range(1, 5)] == pytest.approx([want[s] for s in range(1, 5)],
                                                          rel=1e-5)
    log = (sliced / "train.log").read_text()
    assert "mesh pp=1 × dp=2 × ep=1 × cp=1 × tp=1 (operators: strategies)" in log


def test_semi_auto_recipe_names_a_bad_model_parallel_degree():
    parallel.init()  # one process
    cfg = compose_train(["parallel=semi_auto", "parallel.tensor_degree=3"]).parallel
    with pytest.raises(ValueError, match=r"parallel.tensor_degree=3 must divide the 1 ranks of "
                                         r"a pipeline stage"):
        parallel_mode.apply_parallel_mode(nn.Linear(2, 2), cfg)
    cfg = compose_train(["parallel=semi_auto", "parallel.strategy=null"]).parallel
    with pytest.raises(ValueError, match="parallel=semi_auto needs parallel.strategy"):
        parallel_mode.apply_parallel_mode(nn.Linear(2, 2), cfg)
