"""``trainer.run_name``: a stable run directory (``outputs/runs/NAME``), so a second launch with
``trainer.resume_from=latest`` continues the first, and a launch that forgets ``resume_from`` is
refused rather than mixing two runs; without a name, ``latest`` that finds nothing warns, naming
the setting to use."""

from __future__ import annotations

import subprocess
import sys

import pytest

from foundation.device import ACCELERATOR_ENV
from recipe_helpers import RECIPES, TINY, recipe_env
from recipes.metrics import read_metrics


def _launch(cwd, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(RECIPES / "train.py"), *TINY, "parallel=none",
                           "trainer.checkpoint_every=3", *args], cwd=cwd,
                          env=recipe_env(OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_a_named_run_resumes_across_launches(tmp_path):
    first = _launch(tmp_path, "trainer.run_name=mine", "trainer.max_steps=3",
                    "trainer.resume_from=latest")
    said = first.stdout + first.stderr
    assert "no checkpoint in" in said and "trainer.run_name=NAME" in said
    _launch(tmp_path, "trainer.run_name=mine", "trainer.max_steps=6",
            "trainer.resume_from=latest")
    run = tmp_path / "outputs" / "runs" / "mine"
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert "resumed from" in (run / "train.log").read_text()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step_000003", "step_000006"]
    # a third launch that forgets resume_from would overwrite the run's metrics and keep its
    # checkpoints (a later resume_from=latest would mix two runs): refused, nothing changed
    before = (run / "metrics.jsonl").read_text()
    again = subprocess.run([sys.executable, str(RECIPES / "train.py"), *TINY, "parallel=none",
                            "trainer.run_name=mine", "trainer.max_steps=3"], cwd=tmp_path,
                           env=recipe_env(OMP_NUM_THREADS="1"), capture_output=True, text=True,
                           timeout=150)
    assert again.returncode == 1
    assert "already holds checkpoints of an earlier run (newest: step_000006)" in again.stderr
    assert "trainer.resume_from=latest" in again.stderr
    assert (run / "metrics.jsonl").read_text() == before


def test_a_run_name_with_a_slash_is_refused(tmp_path, monkeypatch):
    """Hydra resolves the run dir before the task: the refusal is one line and exit code 1, not
    the end of a 100-line traceback, and no directory is made."""
    from recipes.run_dir import _run_dir

    assert _run_dir("mine") == "outputs/runs/mine"
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(ValueError, match="trainer.run_name='a/b' must be a non-empty name"):
        _run_dir("a/b")
    monkeypatch.delenv("HYDRA_FULL_ERROR")
    monkeypatch.chdir(tmp_path)
    proc = subprocess.run([sys.executable, str(RECIPES / "train.py"), "trainer.run_name=../up"],
                          env={**recipe_env(), ACCELERATOR_ENV: "none"}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and not list(tmp_path.iterdir())
    assert proc.stderr.strip().splitlines() == [
        "Config error: trainer.run_name='../up' must be a non-empty name without '/' (it names "
        "a directory under outputs/runs/) (set HYDRA_FULL_ERROR=1 for the traceback)"]
