"""``benchmarks/beyond_memory.py`` at a small size: the same child process, disk tier and report as
the 2 B-parameter run, so the headline command keeps working."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import beyond_memory  # noqa: E402


@pytest.mark.parametrize("params", [3e7, 2.0e9])
def test_the_shape_reaches_the_asked_size(params):
    from recipes.gpt import GPT

    layers = beyond_memory.gpt_shape(params, 2560 if params > 1e9 else 512, 8192)
    with torch.device("meta"):
        d = 2560 if params > 1e9 else 512
        count = sum(p.numel() for p in GPT(8192, d, layers, d // 128, 64).parameters())
    assert params <= count < params + 12 * d * d + 13 * d + 64 * d  # one block more at most


def _run(directory: Path, weights: str, *extra: str) -> list[float]:
    done = subprocess.run(
        [sys.executable, str(BENCH / "beyond_memory.py"), "--params", "3e6", "--d-model", "256",
         "--steps", "3", "--lr", "1e-3", "--chunk-mb", "4", "--dir", str(directory),
         "--weights", weights, "--no-deepspeed", *extra],  # its op may build for minutes
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"peak RSS of the training process, sampled from outside: [0-9.]+ GiB",
                     done.stdout)
    assert "direct IO: " in done.stdout and "VmHWM" in done.stdout
    resumed = re.findall(r"a step after the resume: loss ([0-9.]+)", done.stdout)
    return [float(x) for x in re.findall(r"^\| \d+ \| ([0-9.]+) \|", done.stdout, re.M)
            ] + [float(x) for x in resumed]


def test_a_small_run_trains_with_its_state_on_disk_and_cleans_up(tmp_path):
    losses = _run(tmp_path, "host")
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert losses[0] > losses[1] > losses[2]
    # weights made and kept in a file: the same run; then a DCP checkpoint of the weights
    # and the state saved from and loaded back into their files, and one more step
    again = _run(tmp_path, "disk", "--checkpoint")
    assert again[:3] == losses and len(again) == 4 and again[3] < again[2]
    assert list(tmp_path.iterdir()) == []  # the state files and their temp dir are gone
