"""In-job recovery: a rank killed mid-run under ``torchrun --max-restarts 1`` restarts the job,
which resumes from its last checkpoint (``trainer.resume_from=auto``) and ends with the losses
and the final state of a run that was never interrupted (bit for bit: CPU runs are
deterministic). The kill is the recipes' fault injection (``trainer.kill_at``), a real SIGKILL.

Here: which checkpoint ``auto`` takes and when the fault injection fires. The killed job itself
runs in ``test_checkpoint_async.py`` (killed while a save is in flight, the harder case), against
the uninterrupted run it shares with the asynchronous-save test."""

from __future__ import annotations

import pytest

from recipe_helpers import compose_train
from recipes import config_schema
from recipes.fail_early import ConfigError
from recipes.fault_injection import check_kill_at, first_attempt, kill_if_chosen


def test_auto_starts_fresh_without_a_warning_and_resumes_the_newest(tmp_path, caplog):
    from recipes.resume import resume_path

    caplog.set_level("INFO", logger="recipes.resume")
    assert resume_path("auto", tmp_path) is None
    assert "no checkpoint" in caplog.text and "yet" in caplog.text
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    (tmp_path / "step_000004").mkdir()
    (tmp_path / "step_000008.tmp").mkdir()  # a save the kill interrupted: not complete
    assert resume_path("auto", tmp_path) == tmp_path / "step_000004"


def test_kill_at_is_checked_and_fires_only_in_the_first_attempt(monkeypatch):
    cfg = compose_train(["trainer.kill_at=[1,6]"])
    config_schema.check_config(cfg)
    with pytest.raises(ConfigError, match=r"trainer.kill_at=\[2,6\] names rank 2, and this job "
                                          r"has 2 rank\(s\)"):
        check_kill_at([2, 6], 2)
    with pytest.raises(Exception, match="kill_at"):
        config_schema.check_config(compose_train(["trainer.kill_at=[1]"]))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert not first_attempt()
    kill_if_chosen([0, 3], 0, 3)  # a restarted job runs on (this test process survives)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    kill_if_chosen([0, 3], 1, 3)  # another rank, another step: nothing
    kill_if_chosen([0, 3], 0, 4)
