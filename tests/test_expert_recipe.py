"""The GPT recipe with MoE blocks (``model=gpt_moe``) under ``parallel=expert`` (2 ranks, ep=2)
and ``parallel=hybrid_3d_expert`` (8 ranks, pp=2 × dp=2 × ep=2) trains with the losses of one
process on the same global batch,
and a checkpoint written under ep=2 (experts saved whole by DCP) resumes in one process; under
plain data parallel the MoE layers agree routing over the ranks, so they match one process too."""

from __future__ import annotations

import pytest

from recipe_helpers import assert_resumes_in_one_process, assert_same_losses, losses_of, run_recipe

STEPS = ["model=gpt_moe", "trainer.max_steps=4", "trainer.checkpoint_every=2",
         "model.n_layer=2", "model.d_model=64", "model.n_head=4"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    run_recipe([*STEPS, "parallel=none"], None, tmp / "run", tmp / "data")
    return losses_of(tmp / "run"), tmp / "data"



@pytest.mark.slow
@pytest.mark.timeout(300)
def test_expert_recipe_on_two_ranks_matches_one_process_and_resumes_there(tmp_path, single):
    want, cache = single
    run = tmp_path / "ep2"
    run_recipe([*STEPS, "parallel=expert"], 2, run, cache)
    assert_same_losses(losses_of(run), want)
    assert_resumes_in_one_process(run, STEPS, cache, want)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_three_dimensional_expert_recipe_on_eight_ranks_matches_one_process(tmp_path, single):
    """parallel=hybrid_3d_expert: pipeline 2 × data 2 × expert 2 on one (pp, dp, ep, tp) mesh
    of 8 gloo ranks (the MoE layer's experts sharded over ep inside its stage, routing agreed
    over the stage's dp × ep ranks, the balancing loss carried through the pipeline). One
    micro-batch: MoE routing is per micro-batch, and one process routes the whole batch."""
    want, cache = single
    run = tmp_path / "pp2dp2ep2"
    run_recipe([*STEPS, "parallel=hybrid_3d_expert", "parallel.micro_batches=1",
                "parallel.schedule=gpipe"], 8, run, cache, timeout=360)
    assert_same_losses(losses_of(run), want)
    assert "mesh pp=2 × dp=2 × ep=2 × cp=1 × tp=1 (operators: replicas)" in (
        run / "train.log").read_text()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_moe_recipe_under_plain_data_parallel_matches_one_process(tmp_path, single):
    """expert=1: nothing sharded, but routing (capacity, balancing loss) is agreed over the
    ranks, so the MoE layers see the global batch as in one process."""
    want, cache = single
    run = tmp_path / "dp2"
    run_recipe([*STEPS, "parallel=data"], 2, run, cache)
    assert_same_losses(losses_of(run), want)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_expert_recipe_with_two_copies_matches_one_process(tmp_path, single):
    want, cache = single
    run = tmp_path / "copies"
    run_recipe([*STEPS, "parallel=expert", "parallel.multi_copy=2"], 2, run, cache)
    assert_same_losses(losses_of(run), want)
