"""Benchmarks time the device, not the host's issue of work (issue 24, findings 4 and 15).

There is no accelerator here, so the device layer's ``synchronize``/``resolve``/``timing_event``
are replaced by recorders: each benchmark helper must ask the device layer to drain queued work
after its warm-up and at the end of every timed run, put its batches where the stages compute,
time collective waits with the device layer's events, and name the backend in use.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fcol

import foundation.device as hd
import parallel

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
    """A benchmark module, imported as its script sees its siblings (``timing``)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def log(monkeypatch):
    """Records ``synchronize`` and ``barrier`` calls, in order, with the benchmark's own."""
    events: list[str] = []
    monkeypatch.setattr(hd, "synchronize", lambda device=None: events.append("sync"))
    monkeypatch.setattr(parallel, "barrier", lambda *a, **k: events.append("barrier"))
    return events


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_median_ms_drains_the_warm_up_before_the_first_timed_run(log):
    timing = load("timing")
    timing.median_ms(lambda: log.append("run"), repeats=2, warmup=2)
    assert log == ["run", "run", "sync", "barrier", "run", "sync", "barrier", "run", "sync"]


def test_pipeline_timing_synchronizes_every_step_before_its_end(log, monkeypatch):
    pipeline = load("pipeline")
    monkeypatch.setattr(pipeline.parallel.collectives, "all_reduce", lambda t, op="sum": t)
    monkeypatch.setattr(pipeline, "STEPS", 2)
    pipeline._time(lambda: log.append("step"), [0.0])
    timed = log[log.index("sync") + 1:]
    assert log[:3] == ["step", "step", "sync"]
    assert timed == ["barrier", "step", "sync", "barrier"] * 2


def test_pipeline_batches_are_on_the_stages_device(monkeypatch):
    """Emulates an accelerator: "device" resolves to the meta device, as it resolves to cuda:0
    on a GPU; the batch must be made there, not left on the host."""
    pipeline = load("pipeline")
    real = hd.resolve
    monkeypatch.setattr(hd, "resolve", lambda name: torch.device("meta")
                        if name == "device" else real(name))
    x, y = pipeline.data(2)
    assert x.device.type == y.device.type == "meta"
    assert x.shape == y.shape == (2 * pipeline.MICRO, pipeline.SEQ)


def test_moe_exposed_time_is_measured_with_device_timing_events(one_rank, monkeypatch):
    stream_waits = load("stream_waits")
    asked: list[object] = []
    real = hd.timing_event

    def recording(device="device"):
        asked.append(device)
        return real(device)
    monkeypatch.setattr(hd, "timing_event", recording)
    synced = []
    monkeypatch.setattr(hd, "synchronize", lambda device=None: synced.append(device))

    def step() -> None:
        fcol.wait_tensor(fcol.all_reduce(torch.ones(4), "sum", dist.group.WORLD))
        torch.ones(3).sum()  # not a wait: not timed
    ms = stream_waits.exposed_ms(step)
    assert ms >= 0 and len(asked) == 2 and synced == [None]
    assert all(torch.device(d).type == "cpu" for d in asked)  # the waited tensor's device


def test_optimizer_parallel_names_the_backend_in_use(one_rank):
    bench = load("optimizer_parallel")
    assert bench.ranks_line(1, torch.device("cpu")) == "1 gloo ranks"


def test_host_adam_device_row_says_why_it_is_skipped(monkeypatch):
    bench = load("host_adam")
    monkeypatch.setattr(hd, "has_accelerator", lambda: False)
    assert bench.device_row(1024, 1).startswith("device row skipped: no accelerator")


def test_host_adam_times_one_thread_and_the_ranks_cores(monkeypatch):
    bench = load("host_adam")
    monkeypatch.setattr(bench, "cores_per_rank", lambda local: 2)
    seen: list[int] = []
    real = bench.thread_scope

    def recording(threads):
        seen.append(threads)
        return real(threads)
    monkeypatch.setattr(bench, "thread_scope", recording)
    before = torch.get_num_threads()
    rows = bench.thread_rows(bench.State(1024), repeats=1, kernel_type=bench.TorchKernel)
    assert sorted(rows) == [1, 2] and set(seen) == {1, 2}
    assert torch.get_num_threads() == before


def test_parameter_server_device_row_says_why_it_is_skipped(monkeypatch):
    bench = load("parameter_server")
    monkeypatch.setattr(hd, "has_accelerator", lambda: False)
    assert bench.device_row(0, 1).startswith("device row skipped: no accelerator")
