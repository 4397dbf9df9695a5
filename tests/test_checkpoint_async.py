"""Asynchronous checkpoints (``trainer.checkpoint_async=true``): the same checkpoints, bit for
bit, as synchronous saves; a rank killed while a save is being written leaves the previous
checkpoint the newest complete one, and the job torchrun restarts ends as if never interrupted.

The killed run is also the suite's test of in-job recovery (``torchrun --max-restarts 1`` with
``trainer.resume_from=auto``, the kill a real SIGKILL from ``trainer.kill_at``): both compare
with the one uninterrupted run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from recipe_helpers import assert_bitwise_equal, checkpoint_tensors, losses_of, run_recipe

STEPS = ["trainer.max_steps=6", "trainer.checkpoint_every=2", "trainer.resume_from=auto"]
ASYNC = [*STEPS, "trainer.checkpoint_async=true"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, Path]:
    """The asynchronous run on 2 ranks, never interrupted: (its directory, the data cache)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    run_recipe(ASYNC, 2, tmp / "async", tmp / "cache")
    return tmp / "async", tmp / "cache"


@pytest.mark.slow
def test_asynchronous_saves_write_what_synchronous_ones_do(tmp_path, uninterrupted):
    background, cache = uninterrupted
    sync = tmp_path / "sync"
    run_recipe(STEPS, 2, sync, cache)
    assert losses_of(background) == losses_of(sync)
    names = sorted(p.name for p in (background / "checkpoints").iterdir())
    assert names == ["step_000002", "step_000004", "step_000006"]  # all published, no .tmp
    for name in names:
        assert_bitwise_equal(checkpoint_tensors(background / "checkpoints" / name, tmp_path),
                             checkpoint_tensors(sync / "checkpoints" / name, tmp_path))


@pytest.mark.slow
def test_a_kill_while_a_save_is_written_resumes_from_the_one_before(tmp_path, uninterrupted):
    """Rank 1 dies as step 5 begins, while step 4's save is in flight (published at the earliest
    after step 5): step 4 is still ``step_000004.tmp``, torchrun starts the job again, which
    resumes from step 2 and ends bit for bit as the uninterrupted run."""
    whole, cache = uninterrupted
    killed = tmp_path / "killed"
    proc = run_recipe([*ASYNC, "trainer.kill_at=[1,5]"], 2, killed, cache, torchrun=True,
                      timeout=300, launcher_args=["--max-restarts=1"])
    printed = proc.stdout + proc.stderr
    assert "kills itself (SIGKILL) as step 5 begins" in printed
    # torchrun saw the attempt fail (which rank it names as the first failure is a race: the
    # SIGKILLed one, -9, or its peer failing on the broken collective, 1) and started another
    assert re.search(r"failed \(exitcode: (-9|1)\) local_rank: [01]", printed), printed[-2000:]
    assert f"resumed from {killed / 'checkpoints' / 'step_000002'} at step 2" in printed
    assert losses_of(killed) == losses_of(whole)
    assert_bitwise_equal(
        checkpoint_tensors(killed / "checkpoints" / "step_000006", tmp_path),
        checkpoint_tensors(whole / "checkpoints" / "step_000006", tmp_path))


@pytest.mark.slow
def test_checkpoints_by_minutes_are_decided_alike_on_every_rank(tmp_path, uninterrupted):
    """``trainer.checkpoint_every_minutes``: rank 0's clock decides for every rank (a save is
    collective); an interval shorter than a step saves after every step."""
    run = tmp_path / "run"
    run_recipe(["trainer.max_steps=3", "trainer.checkpoint_every=100",
                "trainer.checkpoint_every_minutes=1e-5"], 2, run, uninterrupted[1])
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step_000001", "step_000002", "step_000003"]


def test_checkpoint_minutes_must_be_positive():
    from recipe_helpers import compose_train
    from recipes import config_schema

    with pytest.raises(ValueError, match=r"trainer.checkpoint_every_minutes=0.0 must be > 0"):
        config_schema.check_config(compose_train(["trainer.checkpoint_every_minutes=0"]))


def test_a_stager_that_serves_one_save_is_replaced(tmp_path, monkeypatch):
    """torch 2.11's ``DefaultStager`` closes its state-dict copier after every stage, so a
    second save through it raised ``KeyError: <class 'type'>`` (the lent GPU machines' torch);
    the checkpointer takes a new one where the last is spent. 2.11's behaviour is made here
    by closing the copier after each stage."""
    import torch
    from torch.distributed.checkpoint.staging import DefaultStager

    import parallel
    from recipes.checkpoint_async import AsyncCheckpointer

    stage = DefaultStager._stage

    def stage_once(self, state_dict, **kwargs):
        staged = stage(self, state_dict, **kwargs)
        self._state_dict_stager.close()  # as torch 2.11's does
        return staged

    monkeypatch.setattr(DefaultStager, "_stage", stage_once)
    parallel.init()  # one process
    try:
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.AdamW(model.parameters())
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        saver = AsyncCheckpointer(run=None)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
        first = saver.stager
        for step in (1, 2):
            saver.save(tmp_path, step, model, opt, scheduler=scheduler,
                       device=torch.device("cpu"))
        assert saver.stager is not first
        assert saver.wait() == tmp_path / "step_000002"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001", "step_000002"]
        saver.close()
    finally:
        parallel.destroy()
