"""``trainer.run_name``: a stable run directory (``outputs/runs/NAME``), so a second launch with
``trainer.resume_from=latest`` continues the first; without a name, ``latest`` that finds nothing
warns, naming the setting to use."""

from __future__ import annotations

import subprocess
import sys

import pytest

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


def test_a_run_name_with_a_slash_is_refused():
    from recipes.run_dir import _run_dir

    assert _run_dir("mine") == "outputs/runs/mine"
    with pytest.raises(ValueError, match="trainer.run_name='a/b' must be a non-empty name"):
        _run_dir("a/b")
