"""Fail early and once: the world size is checked from ``WORLD_SIZE`` before any process group
starts, a config error is one line on rank 0 (the other ranks exit quietly with the same code),
``HYDRA_FULL_ERROR=1`` brings the traceback back, an open degree that comes out as 1 warns, and
``--help`` lists the config groups' options without the typed schemas.

The spawned check launches the recipe as torchrun would start its ranks (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``, a torchrun run id) but without the other ranks: had
either process started its process group it would wait for them until killed, so exiting at once
with the error proves the check ran first.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from recipe_helpers import RECIPES, ROOT, compose_train, recipe_env
from recipes.fail_early import (
    EXIT_CODE,
    ConfigError,
    check_world_size,
    config_errors_once,
    env_world_size,
)
from recipes.help_text import config_groups


def _rank_env(rank: int, **extra: str) -> dict[str, str]:
    return recipe_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29431",
                      TORCHELASTIC_RUN_ID="fail-early-test", OMP_NUM_THREADS="1", **extra)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bad_world_size_fails_before_the_process_group_once_and_help_hides_schemas(tmp_path):
    train = [str(RECIPES / "train.py"), "parallel=hybrid_3d"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node=2"]
    jobs = {
        "alone": ([sys.executable, *train, f"hydra.run.dir={tmp_path / 'alone'}"], _rank_env(0)),
        "torchrun": ([*torchrun, *train, f"hydra.run.dir={tmp_path / 'two'}"],
                     recipe_env(OMP_NUM_THREADS="1")),
        "help": ([sys.executable, str(RECIPES / "wide_deep.py"), "--help"], recipe_env()),
        "typo": ([*torchrun, str(RECIPES / "train.py"), "trainer.max_step=1",
                  f"hydra.run.dir={tmp_path / 'typo'}"], recipe_env(OMP_NUM_THREADS="1")),
        "mode": ([sys.executable, str(RECIPES / "train.py"), "model=hf", "parallel=pipeline",
                  "model.config={model_type:xglm,hidden_size:32,num_attention_heads:4}",
                  f"hydra.run.dir={tmp_path / 'mode'}"], _rank_env(0)),
    }
    procs = {k: subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
             for k, (cmd, env) in jobs.items()}
    out = {k: p.communicate(timeout=170) for k, p in procs.items()}  # a rendezvous would hang
    codes = {k: p.returncode for k, p in procs.items()}

    # rank 0 of 2 without its peer: one line, and out before any rendezvous
    lines = out["alone"][1].splitlines()
    assert codes["alone"] == EXIT_CODE and len(lines) == 1, out["alone"]
    assert lines[0].startswith("Config error: parallel=hybrid_3d does not fit this job's 2 "
                               "rank(s) (WORLD_SIZE=2)")
    assert "Fix: launch it on 4, 8, 12, 16, ... ranks (torchrun --nproc-per-node 8" in lines[0]
    assert not (tmp_path / "alone" / "metrics.jsonl").exists()
    # under torchrun: printed once (rank 0 is the first to exit, both ranks exit with code 1)
    said = out["torchrun"][0] + out["torchrun"][1]
    assert codes["torchrun"] != 0 and said.count("Config error:") == 1, said
    assert "exitcode  : -15" not in said, "a rank was killed instead of exiting with the code"
    # a typo Hydra refuses before the recipe runs: once, on one line (it was Hydra's several
    # lines on every rank); the rest is torchrun's own report of the failed job
    said = out["typo"][0] + out["typo"][1]
    assert codes["typo"] != 0 and said.count("Could not override") == 1, said
    assert ("Config error: Could not override 'trainer.max_step'. To append to your config use "
            "+trainer.max_step=1; Key 'max_step' not in 'TrainerConfig' (set HYDRA_FULL_ERROR=1 "
            "for the traceback)\n") in said
    assert "exitcode  : -15" not in said
    # a mode the model cannot train under: one line too (it was a traceback on every rank)
    lines = out["mode"][1].splitlines()
    assert codes["mode"] == EXIT_CODE and len(lines) == 1, out["mode"]
    assert lines[0].startswith("Config error: pipeline stages (parallel.pipeline_degree > 1) of "
                               "model=hf") and "for model_type 'xglm' two stages" in lines[0]
    assert codes["help"] == 0, out["help"]
    assert "_schema" not in out["help"][0]
    assert "parallel: auto, context, data, expert" in out["help"][0]


def test_world_size_rules_name_the_sizes_that_fit():
    with pytest.raises(ConfigError, match=r"parallel=pipeline does not fit this job's 1 rank.*"
                       r"Fix: launch it on 2, 4, 6, 8, \.\.\. ranks \(torchrun "
                       r"--nproc-per-node 4"):
        check_world_size(compose_train(["parallel=pipeline"]), 1)
    with pytest.raises(ConfigError, match=r"Fix: run it in one process \(without torchrun\), "
                       r"or use parallel=data on 2 ranks"):
        check_world_size(compose_train(["parallel=none"]), 2)
    with pytest.raises(ConfigError, match=r"expert_degree=2 must divide the world size 3"):
        check_world_size(compose_train(["parallel=expert", "model=gpt_moe"]), 3)
    assert check_world_size(compose_train(["parallel=hybrid_3d"]), 8).data_degree == 2


def test_an_open_degree_that_comes_out_as_one_warns(caplog, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    cases = [(["parallel=hybrid_3d"], 4, "parallel.data_degree comes out as 1 on 4 rank(s) "
              "(pipeline_degree=2 × tensor_degree=2 take them all)"),
             (["parallel=semi_auto"], 1, "parallel.tensor_degree comes out as 1 on 1 rank(s)")]
    for args, world, said in cases:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="recipes.fail_early"):
            check_world_size(compose_train(args), world)
        assert said in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="recipes.fail_early"):
        check_world_size(compose_train(["parallel=data"]), 1)  # one process: nothing to say
        check_world_size(compose_train(["parallel=data"]), 2)
    assert caplog.text == ""
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ConfigError, match="WORLD_SIZE='two' is not a positive number"):
        env_world_size()


def test_a_config_error_is_one_line_on_rank_zero_only(capsys, monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr("recipes.fail_early.QUIET_WAIT_S", 0.0)  # no torchrun to stop rank 1
    for rank, expect in (("0", 1), ("1", 0)):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as stopped, config_errors_once():
            raise ValueError("optim.lr=-1 must be >= 0;\n  and more")
        assert stopped.value.code == EXIT_CODE
        err = capsys.readouterr().err
        assert len(err.splitlines()) == expect
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(ValueError, match="lr"), config_errors_once():  # Hydra prints it whole
        raise ValueError("optim.lr=-1 must be >= 0")


def test_help_groups_leave_the_schemas_out():
    groups = config_groups()
    assert "model: custom, gpt, gpt_moe, hf, wide_deep" in groups
    assert "schema" not in groups
    assert "parallel.strategy=NAME picks one of: gpt_megatron" in groups


@pytest.mark.parametrize("override, named", [
    ("model.d_model=120000", r"model.d_model=120000 with model.n_layer=4 and model.block_size=64 "
                             r"cannot fit: 691,207,680,000 FP32 parameters"),
    ("model.block_size=100000000000", r"model.block_size=100000000000 cannot fit"),
    ("data.global_batch_size=100000000000", r"data.global_batch_size=100000000000 cannot fit: "
                                            r"the global batch's sampled indices alone take "
                                            r"745.1 GiB per rank"),
])
def test_a_size_no_machine_holds_is_refused_before_allocating(override, named):
    """They reached the allocator ("tried to allocate 172800000000 bytes") after set-up."""
    from recipes.size_check import check_sizes

    cfg = compose_train([override])
    with pytest.raises(ConfigError, match=rf"{named}.*this machine has 24.0 GiB of memory"):
        check_sizes(cfg, 2, capacity=24 * 2**30)
    check_sizes(compose_train([]), 2, capacity=24 * 2**30)  # the default recipe fits


@pytest.mark.parametrize("overrides, world, named", [
    (["data.global_batch_size=3"], 2,
     r"data.global_batch_size=3 does not divide over the 2 ranks that each feed a slice of it"),
    (["parallel=pipeline", "parallel.micro_batches=3"], 2,
     r"each rank's 32 samples per step \(data.global_batch_size=32 over 1 rank\(s\)\) do not "
     r"divide into parallel.micro_batches=3 pipeline micro-batches\. Fix: make "
     r"data.global_batch_size a multiple of 3"),
    (["parallel=pipeline", "parallel.micro_batches=2", "trainer.grad_accum_steps=3"], 2,
     r"into 6 pipeline micro-batches \(parallel.micro_batches=2 × trainer.grad_accum_steps=3\)"),
    (["trainer.grad_accum_steps=3"], 2,
     r"each rank's 16 samples .* do not divide into trainer.grad_accum_steps=3 parts\. Fix: "
     r"make data.global_batch_size a multiple of 6"),
    (["parallel=context", "data.seq_len=62"], 2,
     r"data.seq_len=62 does not divide into the 4 chunks context parallel cuts"),
    (["parallel=expert", "model=gpt_moe", "model.num_experts=3"], 2,
     r"model.num_experts=3 does not divide over parallel.expert_degree=2 ranks"),
])
def test_a_batch_sequence_or_expert_cut_that_does_not_divide_fails_before_the_process_group(
        overrides, world, named):
    """Each used to be raised by every rank at set-up or at the first step, with a traceback
    each, after the process group, data and model were built."""
    from recipes.batch_layout import check_batch_layout

    with pytest.raises(ConfigError, match=named):
        check_batch_layout(compose_train(overrides), world)
    for fine in ([], ["parallel=pipeline"], ["parallel=context"], ["parallel=semi_auto"],
                 ["parallel=pipeline", "data.global_batch_size=3", "parallel.micro_batches=3"],
                 ["parallel=expert", "model=gpt_moe"], ["trainer.grad_accum_steps=4"]):
        check_batch_layout(compose_train(fine), 2)  # the shipped layouts, and a pipeline's
        # batch that only its micro-batches need to divide (not the world size)
