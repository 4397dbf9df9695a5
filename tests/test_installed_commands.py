"""The documented ``python -m recipes.<tool>`` commands work from any directory: ``recipes`` is
installed with the package (``pip install -e .``), not only importable from the repository
root."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.parametrize("tool", ["export", "plot", "generate"])
def test_a_recipe_tool_runs_outside_the_repository(tmp_path, tool):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the install alone
    done = subprocess.run([sys.executable, "-m", f"recipes.{tool}", "--help"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"usage: python -m recipes.{tool}" in done.stdout
