"""The straggler report: at each log line the rank whose forwards lag the median by more than
``trainer.straggler_threshold`` is named, with its lag (``recipes/stragglers.py``)."""

from __future__ import annotations

import time

import pytest

import parallel
from distributed import run_ranks
from recipe_helpers import run_recipe
from recipes.stragglers import StragglerWatch


def _one_slow_rank(rank: int, world: int, slow: int, threshold: float) -> list[str | None]:
    parallel.init()
    watch = StragglerWatch(threshold)
    reports = []
    for window in range(2):
        for _ in range(3):
            with watch.forward():
                time.sleep(0.06 if rank == slow else 0.02)
        reports.append(watch.check(3 * (window + 1)))
    return reports


@pytest.mark.slow
def test_the_slow_rank_is_named_with_its_lag_on_every_rank():
    reports = run_ranks(_one_slow_rank, 4, 2, 0.5)
    for rank_reports in reports:  # the check is collective: every rank has the message
        for report, step in zip(rank_reports, (3, 6), strict=True):
            assert report is not None and report.startswith(
                f"step {step}: rank 2 is the slowest, its forward 6")
            assert "over the last 3 steps (+" in report and "every rank waits for it" in report
    quiet = run_ranks(_one_slow_rank, 2, 1, 5.0)  # 3x is under a threshold of +500 %
    assert quiet == [[None, None], [None, None]]


def test_one_process_has_no_one_to_compare_with():
    watch = StragglerWatch(0.0)
    with watch.forward():
        pass
    assert watch.check(1) is None


@pytest.mark.slow
def test_the_recipe_log_names_the_slowest_rank(tmp_path):
    """A threshold of 0: any difference at all is reported (two ranks never tie exactly)."""
    proc = run_recipe(["trainer.max_steps=4", "trainer.log_every=2",
                       "trainer.straggler_threshold=0"], 2, tmp_path / "run", tmp_path / "cache",
                      output=True)
    printed = proc.stdout + proc.stderr
    assert "is the slowest, its forward" in printed and "over the last 2 steps" in printed
