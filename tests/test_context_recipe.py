"""``parallel=context`` in the GPT recipe: the sequence split over 2 ranks (ring attention),
context 2 × data 2 on 4 ranks (Ulysses), context 2 × tensor 2 (Megatron's strategies) and
context 2 × data 2 under the strategies with optimizer parallel train
with the losses of one process on the same global batch; a checkpoint written under context
parallel resumes in one process."""

from __future__ import annotations

import pytest

from recipe_helpers import (
    HF_TINY,
    assert_resumes_in_one_process,
    assert_same_losses,
    losses_of,
    run_recipe,
)

STEPS = ["trainer.max_steps=4", "trainer.checkpoint_every=2"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    run_recipe([*STEPS, "parallel=none"], None, tmp / "run", tmp / "data")
    return losses_of(tmp / "run"), tmp / "data"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_context_recipe_on_two_ranks_matches_one_process_and_resumes_there(tmp_path, single):
    want, cache = single
    run = tmp_path / "cp2"
    run_recipe([*STEPS, "parallel=context"], 2, run, cache)
    assert_same_losses(losses_of(run), want)
    assert "mesh pp=1 × dp=1 × ep=1 × cp=2 × tp=1" in (run / "train.log").read_text()
    assert_resumes_in_one_process(run, STEPS, cache, want)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, overrides, mesh", [
    ("cp2dp2", ["parallel=context", "parallel.context_method=ulysses"],
     "mesh pp=1 × dp=2 × ep=1 × cp=2 × tp=1"),
    # parallel=semi_auto (Megatron's strategies) with the sequence split
    ("cp2tp2", ["parallel=semi_auto", "parallel.tensor_degree=2", "parallel.context_degree=2"],
     "mesh pp=1 × dp=1 × ep=1 × cp=2 × tp=2"),
    # and with the optimizer sharded over the strategies' data ranks
    ("cp2dp2_level2", ["parallel=semi_auto", "parallel.tensor_degree=1",
                       "parallel.context_degree=2",
                       "parallel.enable_parallel_optimizer=true",
                       "parallel.optimizer_level=level2"],
     "mesh pp=1 × dp=2 × ep=1 × cp=2 × tp=1"),
])
def test_context_with_another_dimension_on_four_ranks_matches_one_process(
        tmp_path, single, name, overrides, mesh):
    want, cache = single
    run = tmp_path / name
    run_recipe([*STEPS, *overrides], 4, run, cache)
    assert_same_losses(losses_of(run), want)
    assert mesh in (run / "train.log").read_text()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_context_with_optimizer_parallel_recipe_matches_one_process(tmp_path, single):
    """The optimizer's state and the weights (level3) sharded over the context ranks."""
    want, cache = single
    run = tmp_path / "cp2_level3"
    run_recipe([*STEPS, "parallel=context", "parallel.enable_parallel_optimizer=true",
                "parallel.optimizer_level=level3"], 2, run, cache)
    assert_same_losses(losses_of(run), want)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_context_with_pipeline_recipe_matches_one_process(tmp_path, single):
    """2 stages × context 2 on 4 ranks: each stage runs on its ranks' halves of the sequence."""
    _, cache = single
    run, two_layers = tmp_path / "pp2_cp2", ["model.n_layer=2"]
    run_recipe([*STEPS, *two_layers, "parallel=pipeline", "parallel.context_degree=2"], 4, run,
               cache)
    one = tmp_path / "one"
    run_recipe([*STEPS, *two_layers, "parallel=none"], None, one, cache)
    assert_same_losses(losses_of(run), losses_of(one))
    assert "mesh pp=2 × dp=1 × ep=1 × cp=2 × tp=1" in (run / "train.log").read_text()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_huggingface_llama_under_context_parallel_matches_one_process(tmp_path):
    """model=hf (grouped-query Llama, rotary positions): the rank's positions reach the rotary
    embedding, so the losses equal one process's."""
    cache, llama = tmp_path / "data", (
        "model.config={model_type:llama,hidden_size:32,intermediate_size:64,"
        "num_hidden_layers:2,num_attention_heads:4,num_key_value_heads:2}")
    run_recipe([*STEPS, "model=hf", llama, "parallel=context"], 2, tmp_path / "cp2", cache,
               tiny=HF_TINY)
    run_recipe([*STEPS, "model=hf", llama, "parallel=none"], None, tmp_path / "one", cache,
               tiny=HF_TINY)
    assert_same_losses(losses_of(tmp_path / "cp2"), losses_of(tmp_path / "one"))
