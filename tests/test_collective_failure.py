"""What a dead or stalled peer does per backend, as ``parallel.init`` sets it up: on NCCL and
HCCL, torch's asynchronous handling by default (``on_collective_failure="abort"``: the watchdog
ends the process, communication overlaps compute), blocking waits without the watchdog's
tear-down with ``"raise"`` (the failed collective raises after the timeout and becomes
``parallel.CollectiveError``); gloo needs nothing. The recipe's ``trainer.collective_timeout_s``
is the process group's timeout.

Checked on CPU by recording what ``init`` hands ``init_process_group`` and the environment at
that moment, for a backend string naming NCCL (the gloo-rank tests in test_comm.py show the
raising itself)."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch.distributed as dist

import parallel
from parallel import comm
from recipe_helpers import compose_train

NCCL_VARS = ("TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
HCCL_VARS = ("HCCL_BLOCKING_WAIT", "HCCL_ASYNC_ERROR_HANDLING")


@pytest.fixture
def recorded_init(monkeypatch):
    """``init_process_group`` replaced by a recorder of its backend, timeout and the failure
    variables set when it is called; the environment restored afterwards."""
    for name in (*NCCL_VARS, *HCCL_VARS, comm.FAILURE_ENV, comm.TIMEOUT_ENV):
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)
    calls: list[dict] = []

    def record(backend, **kwargs):
        calls.append({"backend": backend, "timeout": kwargs["timeout"],
                      "env": {n: os.environ.get(n) for n in (*NCCL_VARS, *HCCL_VARS)}})

    monkeypatch.setattr(dist, "init_process_group", record)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    return calls


def test_nccl_and_hccl_raise_after_the_timeout_when_asked(recorded_init):
    parallel.init("cpu:gloo,cuda:nccl", timeout=42, on_collective_failure="raise")
    (call,) = recorded_init
    assert call["backend"] == "cpu:gloo,cuda:nccl"
    assert call["timeout"] == timedelta(seconds=42)
    assert call["env"]["TORCH_NCCL_BLOCKING_WAIT"] == "1"
    assert call["env"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    assert call["env"]["HCCL_BLOCKING_WAIT"] is None  # only the backends in use
    recorded_init.clear()
    for name in NCCL_VARS:
        os.environ.pop(name)
    parallel.init("cpu:gloo,npu:hccl", on_collective_failure="raise")
    assert recorded_init[0]["env"]["HCCL_BLOCKING_WAIT"] == "1"
    assert recorded_init[0]["env"]["HCCL_ASYNC_ERROR_HANDLING"] == "0"
    assert recorded_init[0]["timeout"] == comm.DEFAULT_TIMEOUT


def test_abort_is_the_default_and_keeps_the_backends_own(recorded_init, monkeypatch):
    """No host waits by default: FSDP2's and DTensor's waits stay asynchronous, overlapping
    communication with compute; the users' variables win over "raise"."""
    parallel.init("cpu:gloo,cuda:nccl")
    assert recorded_init[0]["env"] == dict.fromkeys((*NCCL_VARS, *HCCL_VARS))
    assert comm.failure_env("cpu:gloo,cuda:nccl") == {}
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    assert comm.failure_env("cpu:gloo,cuda:nccl", "raise") == {"TORCH_NCCL_BLOCKING_WAIT": "1"}
    assert comm.failure_env("gloo", "raise") == {}
    monkeypatch.setenv(comm.FAILURE_ENV, "raise")
    assert comm.failure_env("cpu:gloo,cuda:nccl") == {"TORCH_NCCL_BLOCKING_WAIT": "1"}


def test_a_bad_failure_mode_is_refused_by_name(recorded_init, monkeypatch):
    with pytest.raises(ValueError, match=r"on_collective_failure='ignore' must be one of "
                                         r"\['raise', 'abort'\]"):
        parallel.init("gloo", on_collective_failure="ignore")
    monkeypatch.setenv(comm.FAILURE_ENV, "crash")
    with pytest.raises(ValueError, match=r"\$HETERO_PARALLEL_ON_COLLECTIVE_FAILURE='crash'"):
        parallel.init("gloo")
    assert recorded_init == []


def test_the_recipe_passes_its_collective_timeout(recorded_init, monkeypatch, tmp_path):
    from recipes import config_schema
    from recipes.train import TrainRecipe

    monkeypatch.setattr(parallel, "get_rank", lambda: 0)
    monkeypatch.setattr(parallel, "get_world_size", lambda: 1)
    for value, want in (("7.5", timedelta(seconds=7.5)), ("null", comm.DEFAULT_TIMEOUT)):
        cfg = compose_train([f"trainer.collective_timeout_s={value}"])
        config_schema.check_config(cfg)
        TrainRecipe(cfg, tmp_path).init_distributed()
        assert recorded_init.pop()["timeout"] == want
    with pytest.raises(ValueError, match="collective_timeout_s"):
        config_schema.check_config(compose_train(["trainer.collective_timeout_s=0"]))


@pytest.mark.npu
def test_an_npu_process_group_reduces_over_hccl_and_raises_on_failure():
    """On an Ascend machine: the group serves the NPU with HCCL, set up to raise, and a device
    all-reduce works (HCCL has no AVG: the project's mean is a SUM and a division)."""
    import torch

    import foundation.device as hd

    parallel.init(timeout=30, on_collective_failure="raise")
    device = hd.resolve("device")
    assert hd.group_backend(None, device) == "hccl"
    assert not hd.supports_average_reductions("hccl")
    assert os.environ.get("HCCL_BLOCKING_WAIT") == "1"
    out = parallel.collectives.all_reduce(torch.ones(4, device=device), op="mean")
    assert out.device == device and out.cpu().tolist() == [1.0] * 4
