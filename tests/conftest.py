"""Shared fixtures: keep every test's process free of a leftover process group and context, and
of a device profile this machine's user saved (auto parallel plans with the default one)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

import foundation.device as hd
import parallel

# the benchmarks' helpers the tests share (ports.py, peak_tensor_bytes.py); spawned ranks inherit
# the path
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

if os.environ.get("PYTEST_XDIST_WORKER"):
    # each xdist worker computes beside the others and their spawned ranks (one thread each):
    # torch's default of one thread per core would put more threads than cores on the machine
    torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _no_saved_device_profile(tmp_path_factory):
    """``parallel.auto.profile_devices()`` saves a profile that plans then use; tests plan with the
    defaults, so they read (and write) an empty cache of their own. Spawned ranks and recipe
    processes inherit the variable."""
    previous = os.environ.get("HETERO_PARALLEL_CACHE")
    os.environ["HETERO_PARALLEL_CACHE"] = str(tmp_path_factory.mktemp("profile-cache"))
    yield
    if previous is None:
        os.environ.pop("HETERO_PARALLEL_CACHE", None)
    else:
        os.environ["HETERO_PARALLEL_CACHE"] = previous


@pytest.fixture(scope="session")
def default_recipe_single(tmp_path_factory) -> tuple[Path, Path, str]:
    """The default recipe for 4 steps in one plain process (``parallel=none``), as a user runs
    it: (its run directory, its data cache, what it printed). The tests that compare a parallel
    run of the default recipe with one process share it (and the cache) instead of each running
    it again."""
    from recipe_helpers import run_recipe

    tmp = tmp_path_factory.mktemp("default_single")
    proc = run_recipe(["trainer.max_steps=4", "parallel=none"], None, tmp / "run", tmp / "data",
                      output=True)
    return tmp / "run", tmp / "data", proc.stdout


@pytest.fixture(autouse=True)
def _clean_parallel_state():
    parallel.context.reset_auto_parallel_context()
    yield
    parallel.destroy()
    parallel.context.reset_auto_parallel_context()


#: marker -> (the accelerator type its tests need, why they are skipped without it)
_DEVICE_MARKERS = {"cuda": ("cuda", "needs a CUDA GPU"),
                   "npu": ("npu", "needs an Ascend NPU and torch_npu")}


#: the files that take longest on three xdist workers (``--durations=0``, mean of two fresh-clone
#: runs, 2026-12-07), longest first. ``--dist loadfile`` hands files out in collection order, so
#: these start first and the shorter ones fill in behind them: in alphabetical order the longest
#: came last (test_wide_deep*), and one worker ran them alone while the others had nothing left.
_LONGEST_FIRST = (
    "test_hf_recipe.py", "test_pipeline_recipe.py", "test_wide_deep.py", "test_comm.py",
    "test_context_recipe.py", "test_semi_auto_hetero.py", "test_deferred_init.py",
    "test_offload_recipe.py", "test_auto_parallel_recipe.py", "test_sharded_load.py",
    "test_optimizer_parallel.py", "test_pipeline.py", "test_optimizer_parallel_recipe.py",
    "test_context_tensor.py", "test_model_zoo.py", "test_deferred_combos.py", "test_elastic.py",
    "test_expert_recipe.py", "test_training_settings.py", "test_docs_snippets.py",
    "test_deferred_spmd.py", "test_auto_recompute.py", "test_launchers.py",
    "test_expert_combinations.py", "test_checkpoint_async.py", "test_recipe_reliability.py",
    "test_memory_scale_benchmark.py", "test_grad_accum.py",
)


def _longest_files_first(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole


def pytest_collection_modifyitems(config, items):
    _longest_files_first(items)
    present = hd.accelerator_type() if torch.accelerator.is_available() else None
    for marker, (kind, reason) in _DEVICE_MARKERS.items():
        if present == kind:
            continue
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            if item.get_closest_marker(marker) is not None:
                item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    """The pooled gloo ranks (``rank_pool.py``) end with the session."""
    from rank_pool import close_pools

    close_pools()
