"""``trainer.grad_accum_steps``: N forward/backward passes over N parts of the step's batch, one
update — the same losses and parameters as the whole batch in one pass, in every mode: the
data-parallel wrappers reduce once (``no_sync``), optimizer parallel's FSDP2 units skip their
gradient sync until the last part, semi-auto's DTensor gradients accumulate, and a pipeline runs
N times its micro-batches."""

from __future__ import annotations

import pytest

from recipe_helpers import assert_same_losses, losses_of, run_recipe

STEPS = ["trainer.max_steps=4", "model.n_layer=2", "trainer.checkpoint_every=4"]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("whole")
    run_recipe([*STEPS, "parallel=none"], None, tmp / "run", tmp / "data")
    return losses_of(tmp / "run"), tmp / "data"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", [
    ["parallel=none"],
    ["parallel=data"],
    ["parallel=semi_auto"],
    ["parallel=pipeline", "parallel.micro_batches=2"],
    ["parallel=data", "parallel.enable_parallel_optimizer=true", "parallel.optimizer_level=level2",
     "parallel.parallel_optimizer_threshold=0"],
], ids=["one process", "data", "semi_auto", "pipeline", "optimizer level2"])
def test_accumulated_parts_train_like_the_whole_batch(tmp_path, whole, mode):
    want, cache = whole
    run = tmp_path / "accumulated"
    nproc = None if mode == ["parallel=none"] else 2
    run_recipe([*STEPS, *mode, "trainer.grad_accum_steps=2"], nproc, run, cache)
    assert_same_losses(losses_of(run), want)


@pytest.mark.slow
def test_a_batch_the_parts_do_not_divide_is_refused_by_name(tmp_path):
    import subprocess
    import sys

    from recipe_helpers import RECIPES, ROOT, TINY, recipe_env

    done = subprocess.run([sys.executable, str(RECIPES / "train.py"), *TINY, *STEPS,
                           "parallel=none", "trainer.grad_accum_steps=3",
                           f"hydra.run.dir={tmp_path / 'run'}",
                           f"data.cache_dir={tmp_path / 'data'}"],
                          cwd=ROOT, env=recipe_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode != 0  # one config-error line, before any set-up (recipes/batch_layout)
    assert done.stderr.startswith("Config error: each rank's 8 samples per step "
                                  "(data.global_batch_size=8 over 1 rank(s)) do not divide into "
                                  "trainer.grad_accum_steps=3 parts. Fix: make "
                                  "data.global_batch_size a multiple of 3"), done.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
