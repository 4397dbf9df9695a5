"""Wide&Deep writes checkpoints and resumes bit for bit, as the GPT recipe does.

Run A trains straight to step 6 (checkpoints at 3 and 6); run B resumes from A's step 3 and must
log A's losses for steps 4..6 and write A's step-6 checkpoint exactly: the tables, the dense part,
Adam's and the sparse optimizer's state, the schedule and the RNG states (dropout is on). In one
process with whole host tables and LazyAdam; on two ranks with the parameter server (row-sharded
tables with a device cache, saved whole) and FTRL, resumed with ``trainer.run_name`` +
``resume_from=latest`` as a user does (and exported: the blocks become whole tables).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from recipe_helpers import (
    RECIPES,
    assert_bitwise_equal,
    checkpoint_tensors,
    losses_of,
    recipe_env,
)
from recipes import config_schema
from recipes.checkpoint import latest_checkpoint
from recipes.export import export
from recipes.export_gpt2 import NotGPT2Error

SMALL = ["data.rows=4000", "data.vocab_size=2000", "data.global_batch_size=64",
         "model.embedding_size=4", "model.deep_layers=[16]", "model.dropout=0.1",
         "trainer.eval_every=100", "trainer.progress_bar=false", "optim.warmup_steps=2",
         "optim.total_steps=8", "trainer.max_steps=6", "trainer.checkpoint_every=3"]


def _in_process(run: Path, args: list[str]) -> None:
    from recipes.wide_deep import WideDeepRecipe
    from test_wide_deep import compose_wide_deep

    cfg = compose_wide_deep([*SMALL, *args])
    config_schema.check_config(cfg)
    recipe = WideDeepRecipe(cfg, run)
    try:
        recipe.setup()
        recipe.train()
    finally:
        recipe.cleanup()


def _assert_resumed(a: Path, b: Path, tmp: Path) -> None:
    a_losses, b_losses = losses_of(a), losses_of(b)
    assert sorted(b_losses) == [4, 5, 6]
    assert [b_losses[s] for s in (4, 5, 6)] == [a_losses[s] for s in (4, 5, 6)]
    got = checkpoint_tensors(b / "checkpoints" / "step_000006", tmp)
    assert any(k.startswith("optim.state.deep_table.weight.") for k in got)  # sparse state
    assert_bitwise_equal(checkpoint_tensors(a / "checkpoints" / "step_000006", tmp), got)


def test_one_process_resume_equals_the_uninterrupted_run(tmp_path):
    cache = f"data.cache_dir={tmp_path / 'data'}"
    a, b = tmp_path / "a", tmp_path / "b"
    _in_process(a, ["parallel=none", cache])
    assert latest_checkpoint(a / "checkpoints").name == "step_000006"
    assert (a / "checkpoints" / "step_000003" / "config.yaml").is_file()
    _in_process(b, ["parallel=none", cache,
                    f"trainer.resume_from={a / 'checkpoints' / 'step_000003'}"])
    _assert_resumed(a, b, tmp_path)
    with pytest.raises(NotGPT2Error, match="model=wide_deep is not a transformers model"):
        export(b / "checkpoints" / "step_000006", "hf", tmp_path / "hf")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_rank_parameter_server_resumes_from_latest_of_a_named_run(tmp_path):
    """The run is launched again with the same run name and resume_from=latest after losing its
    step-6 checkpoint (kept aside to compare), so it continues from step 3."""
    cache = f"data.cache_dir={tmp_path / 'data'}"
    common = [*SMALL, cache, "embedding=ps", "model.embedding_cache_size=64",
              "sparse_optim=ftrl", "hydra.job.chdir=false"]

    def launch(*args: str) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", str(RECIPES / "wide_deep.py"), *common, *args]
        proc = subprocess.run(cmd, cwd=tmp_path, env=recipe_env(OMP_NUM_THREADS="1"),
                              capture_output=True, text=True, timeout=150)
        assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"

    launch("trainer.run_name=ctr")
    run = tmp_path / "outputs" / "wide_deep" / "runs" / "ctr"
    straight, ckpts = losses_of(run), run / "checkpoints"
    (ckpts / "step_000006").rename(tmp_path / "straight_step_000006")  # as if stopped at 3
    launch("trainer.run_name=ctr", "trainer.resume_from=latest")
    assert "resumed from" in (run / "wide_deep.log").read_text()
    assert losses_of(run) == straight  # 1..3 from the first launch, 4..6 from the second
    assert_bitwise_equal(checkpoint_tensors(tmp_path / "straight_step_000006", tmp_path),
                         checkpoint_tensors(ckpts / "step_000006", tmp_path))
    # the parameter server's blocks export as whole tables
    tables = load_file(export(ckpts / "step_000006", "safetensors",
                              tmp_path / "wd.safetensors"))
    assert tables["deep_table.weight"].shape == (2000, 4)
