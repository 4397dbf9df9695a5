"""``benchmarks/memory_scale.py``: its command line, its model sizes and the activation rows run
here in one process; the whole benchmark at a tiny size on 2 spawned ranks is the slow case."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import memory_scale  # noqa: E402


def test_command_line_defaults_and_bad_sizes():
    args = memory_scale.parse([])
    assert (args.params, args.ranks, args.steps) == (1.5e8, 4, 2)
    assert memory_scale.parse(["--params", "6.5e8", "--ranks", "2"]).params == 6.5e8
    with pytest.raises(ValueError, match="--ranks must be at least 1, got 0"):
        memory_scale.parse(["--ranks", "0"])


@pytest.mark.parametrize("params", [2e5, 1.5e8, 6.5e8])
def test_shape_is_about_the_asked_size(params):
    from recipes.gpt import GPT

    d_model, layers, heads = memory_scale.shape(params, 50304)
    assert d_model % 64 == 0 and d_model == 64 * heads
    with torch.device("meta"):
        count = sum(p.numel() for p in GPT(50304, d_model, layers, heads, 128).parameters())
    if params > 1e7:  # a tiny one is the smallest width's embedding
        assert count == pytest.approx(params, rel=0.1)


def test_recompute_rows_hold_less_in_order():
    held = memory_scale.activations()
    assert held["full"] < held["selective"] < held["none"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_benchmark_runs_tiny_on_two_ranks():
    out = subprocess.run([sys.executable, str(BENCH / "memory_scale.py"), "--params", "3e6",
                          "--ranks", "2", "--steps", "1", "--seq", "32"],
                         capture_output=True, text=True, timeout=280, check=True).stdout
    assert "optimizer parallel level3, deferred init, 2 gloo ranks" in out
    assert "(step-ovh)/(state/N)" in out and "goal step peak" in out
    assert [line.split()[0] for line in out.splitlines()[-3:]] == ["none", "selective", "full"]


def test_recipe_memory_command_line_refuses_bad_sizes():
    import recipe_memory

    assert recipe_memory.parse([]).params == 1.5e8
    with pytest.raises(ValueError, match="--steps must be at least 1, got 0"):
        recipe_memory.parse(["--steps", "0"])


def test_recipe_memory_finds_each_rank_under_an_agent():
    """The sampler reads the ranks torchrun started by their RANK, not the agent itself."""
    import psutil
    import recipe_memory

    code = "import time; time.sleep(30)"
    kids = [subprocess.Popen([sys.executable, "-c", code], env={"RANK": str(r), "PATH": ""})
            for r in (1, 0)]
    try:
        time.sleep(0.5)  # both exec'd
        found = recipe_memory._rank_rss(psutil.Process())
        assert sorted(found) == [0, 1] and all(rss > 0 for rss in found.values())
    finally:
        for kid in kids:
            kid.kill()
            kid.wait()
