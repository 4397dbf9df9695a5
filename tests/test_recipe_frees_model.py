"""A model trained through the GPT recipe is freed once the run is over, in every one-process
mode: a sweep (``--multirun`` runs its jobs one after another in one process) or a notebook
trains model after model, and each one kept would keep its weights, gradients and optimizer
state for the life of the process.

What kept them before: hooks that C++ holds (a parameter's gradient hooks, an autograd node's),
which Python's collector cannot follow, closing a cycle back to the model (parameter offload's
gradient hook held each parameter's home; an MoE layer held a balancing loss recomputed in
backward, whose graph nobody let go)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest

from recipe_helpers import train_in_process

MODES = {
    "plain": [],
    "moe": ["model=gpt_moe"],
    "moe, full recompute": ["model=gpt_moe", "trainer.recompute=full"],
    "selective recompute": ["trainer.recompute=selective"],
    "activations on the host": ["offload=activations"],
    "parameters on the host": ["offload=params"],
    "moe, parameters on the host": ["model=gpt_moe", "offload=params"],
    "parameters on disk": ["offload=disk"],
    "optimizer on the host": ["offload=optimizer", "hetero.offload_kernel=torch"],
    "embedding on the host": ["hetero=embedding_on_cpu"],
    "meta init": ["model.init_device=meta"],
    "fp16, accumulation": ["trainer.precision=fp16", "trainer.grad_accum_steps=2"],
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data")


@pytest.mark.parametrize("mode", list(MODES))
def test_a_trained_model_is_freed_when_the_run_is_over(mode, cache, tmp_path):
    held: list[weakref.ref] = []

    def remember(recipe) -> None:
        held.extend(weakref.ref(p) for p in recipe.model.parameters())

    train_in_process(["parallel=none", "trainer.max_steps=2", *MODES[mode]], tmp_path / "run",
                     cache, patch=remember)
    gc.collect()
    assert held, "the recipe built no parameters"
    kept = sum(ref() is not None for ref in held)
    assert kept == 0, f"{kept} of {len(held)} parameters outlived the run"
