"""Shared fixtures: keep every test's process free of a leftover process group and context, and
of a device profile this machine's user saved (auto parallel plans with the default one)."""

from __future__ import annotations

import os

import pytest
import torch

import foundation.device as hd
import parallel


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


@pytest.fixture(autouse=True)
def _clean_parallel_state():
    parallel.context.reset_auto_parallel_context()
    yield
    parallel.destroy()
    parallel.context.reset_auto_parallel_context()


#: marker -> (the accelerator type its tests need, why they are skipped without it)
_DEVICE_MARKERS = {"cuda": ("cuda", "needs a CUDA GPU"),
                   "npu": ("npu", "needs an Ascend NPU and torch_npu")}


def pytest_collection_modifyitems(config, items):
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
