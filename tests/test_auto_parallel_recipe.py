"""The GPT recipe under ``parallel=auto``: two annotation lines
(conf/strategy/gpt_mlp_columns.yaml), the rest planned by sharding propagation; trains with the
losses of one process."""

from __future__ import annotations

import pytest

from recipe_helpers import losses_of, run_recipe

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
@pytest.mark.timeout(300)
def test_searched_recipe_without_annotations_matches_one_process(tmp_path):
    cache = tmp_path / "data"
    run_recipe([*STEPS, "parallel=none"], None, tmp_path / "single", cache)
    want = losses_of(tmp_path / "single")
    run = tmp_path / "searched"
    run_recipe([*STEPS, "parallel=auto", "parallel.strategy=null",
                "parallel.search_mode=dynamic_programming"], 2, run, cache)
    got = losses_of(run)
    assert [got[s] for s in range(1, 5)] == pytest.approx([want[s] for s in range(1, 5)],
                                                          rel=1e-5)
    assert "dynamic_programming" in (run / "train.log").read_text()
