"""Shared fixtures: keep every test's process free of a leftover process group and context."""

from __future__ import annotations

import pytest
import torch

import hetero.device as hd
import parallel


@pytest.fixture(autouse=True)
def _clean_parallel_state():
    parallel.reset_auto_parallel_context()
    yield
    parallel.destroy()
    parallel.reset_auto_parallel_context()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    if hd.accelerator_type() != "cuda" or not torch.accelerator.is_available():
        for item in items:
            if item.get_closest_marker("cuda") is not None:
                item.add_marker(skip)
