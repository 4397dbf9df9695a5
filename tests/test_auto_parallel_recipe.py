"""The GPT recipe under ``parallel=auto``: two annotation lines
(conf/strategy/gpt_mlp_columns.yaml), the rest planned by sharding propagation; trains with the
losses of one process."""

from __future__ import annotations

import pytest

from recipe_helpers import assert_same_losses, losses_of, run_recipe
from torch_features import SPMD_SHARDING

STEPS = ["trainer.max_steps=4", "model.n_layer=2"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_auto_recipe_matches_one_process_and_logs_its_plan(tmp_path):
    cache = tmp_path / "data"
    run_recipe([*STEPS, "parallel=none"], None, tmp_path / "single", cache)
    want = losses_of(tmp_path / "single")
    run = tmp_path / "auto"
    run_recipe([*STEPS, "parallel=auto"], 2, run, cache)
    got = losses_of(run)
    assert [got[s] for s in range(1, 5)] == pytest.approx([want[s] for s in range(1, 5)],
                                                          rel=1e-5)
    log = (run / "train.log").read_text()
    assert "auto parallel plan on 2 devices" in log and "annotated" in log
    assert "blocks.0.mlp.2" in log


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_searched_recipes_without_annotations_match_one_process(tmp_path):
    """Both searches, no annotation file: dynamic programming on 2 and 4 ranks, recursive
    programming on 2."""
    cache = tmp_path / "data"
    run_recipe([*STEPS, "parallel=none"], None, tmp_path / "single", cache)
    want = losses_of(tmp_path / "single")
    for mode, nproc in (("dynamic_programming", 2), ("dynamic_programming", 4),
                        ("recursive_programming", 2)):
        run = tmp_path / f"{mode}{nproc}"
        run_recipe([*STEPS, "parallel=auto", "parallel.strategy=null",
                    f"parallel.search_mode={mode}"], nproc, run, cache, timeout=240)
        got = losses_of(run)
        assert [got[s] for s in range(1, 5)] == pytest.approx(
            [want[s] for s in range(1, 5)], rel=1e-5), (mode, nproc)
        assert mode in (run / "train.log").read_text()


#: optimizer parallel over the searched layout: FSDP2's SPMD mode (torch >= 2.13)
OPTIMIZER_CASE = [] if SPMD_SHARDING else [
    ("optimizer", ["parallel.search_mode=recursive_programming", "parallel.tensor_degree=2",
                   "parallel.enable_parallel_optimizer=true", "parallel.optimizer_level=level1"])]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_searched_plans_combine_with_pipeline_and_optimizer_parallel(tmp_path):
    """4 ranks: two pipeline stages of 2 ranks, each stage planned by dynamic programming;
    recursive programming keeping a data axis of 2 for optimizer parallel (level1), parameters
    split over at most 2 ranks; and dynamic programming keeping a data axis of 2 whose ranks
    each load their own half of the batch (full_batch=false). All train with the losses of one
    process."""
    cache = tmp_path / "data"
    run_recipe([*STEPS, "parallel=none"], None, tmp_path / "single", cache)
    want = losses_of(tmp_path / "single")
    for name, extra in (
            ("pipeline", ["parallel.search_mode=dynamic_programming", "parallel.pipeline_degree=2",
                          "parallel.micro_batches=2"]),
            *OPTIMIZER_CASE,
            ("slices", ["parallel.search_mode=dynamic_programming", "parallel.tensor_degree=2",
                        "parallel.full_batch=false"])):
        run = tmp_path / name
        run_recipe([*STEPS, "parallel=auto", "parallel.strategy=null", *extra], 4, run, cache,
                   timeout=240)
        assert_same_losses(losses_of(run), want)
        log = (run / "train.log").read_text()
        assert ("stage 1: modelled" in log) == (name == "pipeline"), name
