"""Device resolution, backend choice, host buffers/streams/events (hetero.device)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist

import foundation.device as hd

needs_no_accelerator = pytest.mark.skipif(hd.has_accelerator(), reason="host-only behaviour")


@pytest.mark.parametrize("name", ["cpu", "CPU", "cpu:0", torch.device("cpu")])
def test_cpu_names_resolve_to_host(name):
    assert hd.resolve(name) == torch.device("cpu")
    assert hd.logical_name(name) == "cpu"


@pytest.mark.parametrize("name", ["device", "DEVICE"])
def test_device_resolves_to_the_accelerator(name):
    assert hd.resolve(name) == hd.accelerator()
    assert hd.logical_name(name) == "device"


@needs_no_accelerator
def test_without_accelerator_device_is_the_host():
    assert hd.accelerator_type() is None
    assert hd.accelerator() == torch.device("cpu")
    # Logical names stay distinct even where they resolve to the same hardware.
    assert hd.logical_name("DEVICE") == "device"


@pytest.mark.parametrize("bad", ["TPU", "gpu0", "GPU", "CUDA", "cuda0", "", "device0"])
def test_unknown_names_list_the_accepted_ones(bad):
    with pytest.raises(ValueError) as err:
        hd.resolve(bad)
    message = str(err.value)
    assert repr(bad) in message
    for accepted in hd.ACCEPTED_NAMES:
        assert repr(accepted) in message


@needs_no_accelerator
@pytest.mark.parametrize("absent", ["cuda", "cuda:1", "npu", "npu:0"])
def test_absent_accelerator_is_a_clear_error(absent):
    with pytest.raises(ValueError, match="not available on this machine"):
        hd.resolve(absent)


def test_non_string_device_is_a_type_error():
    with pytest.raises(TypeError, match="str or torch.device"):
        hd.resolve(0)


@pytest.mark.parametrize(
    ("device", "backend"),
    [("cpu", "gloo"), ("CPU", "gloo"), ("cuda", "nccl"), ("cuda:3", "nccl"),
     (torch.device("cpu"), "gloo")],
)
def test_backend_comes_from_torch_map(device, backend):
    assert hd.backend_for(device) == backend
    name = device if isinstance(device, str) else device.type
    assert dist.Backend.default_device_backend_map[name.split(":")[0].lower()] == backend


def test_npu_maps_to_hccl_without_torch_npu(monkeypatch):
    # torch_npu adds "npu" -> "hccl" to torch's map when imported; with it absent the mapping
    # must still be known, so an NPU job can be planned and configured from any host.
    monkeypatch.delitem(dist.Backend.default_device_backend_map, "npu", raising=False)
    assert hd.backend_for("npu") == "hccl"
    assert hd.backend_for("npu:7") == "hccl"


def test_torch_map_wins_over_fallback(monkeypatch):
    monkeypatch.setitem(dist.Backend.default_device_backend_map, "npu", "custom-ccl")
    assert hd.backend_for("npu") == "custom-ccl"


def test_unknown_device_type_has_no_backend():
    with pytest.raises(ValueError, match="no collective backend .* 'tpu'"):
        hd.backend_for("tpu")


def test_default_backend_string_covers_host_and_accelerator():
    parts = hd.default_backend_string().split(",")
    assert parts[0] == "cpu:gloo"
    if hd.has_accelerator():
        acc = hd.accelerator_type()
        assert parts[1] == f"{acc}:{hd.backend_for(acc)}"
    else:
        assert parts == ["cpu:gloo"]


@pytest.mark.parametrize("config, host", [("cpu:gloo,cuda:nccl", True), ("gloo", True),
                                           ("cpu:gloo", True), ("cuda:nccl", False),
                                           ("nccl", False), ("npu:hccl", False)])
def test_a_group_has_a_host_backend_exactly_when_its_config_names_one(monkeypatch, config,
                                                                      host):
    """Where small host-known exchanges (signatures, counts) can travel without a device read."""
    monkeypatch.setattr(hd.dist, "get_backend_config", lambda group=None: config)
    assert hd.has_host_backend(None) is host


def test_pinned_buffer_is_pinned_exactly_when_possible():
    buf = hd.pinned_empty((3, 4), torch.float16)
    assert buf.shape == (3, 4) and buf.dtype == torch.float16 and buf.device.type == "cpu"
    assert buf.is_pinned() == hd.can_pin()
    x = torch.arange(5.0)
    assert torch.equal(hd.pin(x), x)
    with pytest.raises(ValueError, match="only host tensors"):
        hd.pin(torch.empty(1, device="meta"))


def test_stream_event_order_work_on_any_device():
    side = hd.new_stream("device")
    done = hd.new_event("device")
    src = torch.arange(6.0, device=hd.resolve("device"))
    hd.wait_stream(side, hd.current_stream("device"))
    with side:
        out = src * 2
    done.record(side)
    done.wait(hd.current_stream("device"))
    done.synchronize()
    assert done.query()
    hd.synchronize()
    assert torch.equal(out.cpu(), torch.arange(6.0) * 2)


@pytest.mark.cuda
def test_cuda_pinned_and_events():
    assert hd.resolve("device").type == hd.accelerator_type()
    buf = hd.pin(torch.ones(1024))
    assert buf.is_pinned()
    dev = hd.resolve("device")
    stream, event = hd.new_stream(), hd.new_event()
    with stream:
        y = buf.to(dev, non_blocking=True) * 3
    event.record(stream)
    event.synchronize()
    assert float(y.sum()) == 3 * 1024


@pytest.fixture
def fake_accelerator(monkeypatch):
    """The device layer believing in ``count`` visible "cuda" devices: returns a setter for the
    count and the list of indices the process was bound to."""
    state = {"count": 1, "current": 0}
    bound: list[int] = []

    def bind(index: int) -> None:
        bound.append(index)
        state["current"] = index

    monkeypatch.delenv(hd.ACCELERATOR_ENV, raising=False)
    monkeypatch.setattr(hd, "_discovered_type", lambda: "cuda")
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: state["count"])
    monkeypatch.setattr(torch.accelerator, "set_device_index", bind)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: state["current"])

    def visible(count: int) -> list[int]:
        state["count"] = count
        return bound

    return visible


def test_a_process_with_one_visible_device_uses_it_whatever_its_local_rank(fake_accelerator):
    """SLURM, Kubernetes and per-rank CUDA_VISIBLE_DEVICES give each process one visible
    device while LOCAL_RANK counts the node's processes."""
    bound = fake_accelerator(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert hd.set_local_device(3) == torch.device("cuda", 0)
    assert bound == [0]


def test_local_ranks_beyond_the_visible_devices_wrap_with_a_warning(fake_accelerator):
    bound = fake_accelerator(2)
    assert hd.set_local_device(1) == torch.device("cuda", 1)
    with pytest.warns(RuntimeWarning, match=r"LOCAL_RANK=3 but only 2 .*local_rank % 2"):
        assert hd.set_local_device(3) == torch.device("cuda", 1)
    assert bound == [1, 1]
    with pytest.raises(ValueError, match="LOCAL_RANK=-1 must be >= 0"):
        hd.set_local_device(-1)


def test_hidden_accelerator_keeps_the_process_on_the_host(fake_accelerator, monkeypatch):
    """The multi-rank test helper's gloo ranks: on a GPU machine they must not all bind (and
    reduce over NCCL on) device 0."""
    from distributed import rank_env

    bound = fake_accelerator(1)
    monkeypatch.setenv(hd.ACCELERATOR_ENV, rank_env(2, 4, 1234)[hd.ACCELERATOR_ENV])
    assert hd.set_local_device(2) == torch.device("cpu")
    assert hd.resolve("device") == torch.device("cpu")
    assert hd.default_backend_string() == "cpu:gloo"
    assert bound == []
    monkeypatch.setenv(hd.ACCELERATOR_ENV, "gpu")
    with pytest.raises(ValueError, match="HETERO_PARALLEL_ACCELERATOR='gpu'.*'auto'.*'none'"):
        hd.accelerator_type()


@pytest.mark.parametrize("given, used", [
    ("nccl", "cpu:gloo,cuda:nccl"), ("cuda:nccl", "cpu:gloo,cuda:nccl"),
    ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl"), ("gloo", "gloo"), ("cpu:gloo", "cpu:gloo"),
])
def test_an_accelerator_backend_alone_gets_the_hosts_added(given, used):
    """parallel.init("nccl") would leave host tensors (the reducer's host buckets, offloaded
    gradients) without a backend: the host's is added."""
    assert hd.with_host_backend(given) == used


def test_init_adds_the_hosts_backend(monkeypatch):
    import parallel.comm

    asked = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: asked.append(backend))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(parallel.comm, "failure_env", lambda *args: {})  # no NCCL variables
    parallel.comm.init("nccl")
    assert asked == ["cpu:gloo,cuda:nccl"]


def test_machine_memory_reads_this_rank_s_own_device_without_a_context(monkeypatch):
    """The recipes check sizes before a rank binds its device: the memory bound comes from the
    rank's own device's properties, never a memory query on device 0 (a context there from
    every rank of the node)."""
    import types

    asked = []
    fake = types.SimpleNamespace(get_device_properties=lambda i: asked.append(i) or
                                 types.SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setattr(hd, "has_accelerator", lambda: True)
    monkeypatch.setattr(hd, "accelerator_type", lambda: "cuda")
    monkeypatch.setattr(hd, "device_count", lambda: 8)
    monkeypatch.setattr(torch, "cuda", fake)
    monkeypatch.setattr(torch.accelerator, "get_memory_info",
                        lambda *a: pytest.fail("a memory query makes a context"))
    monkeypatch.setenv("LOCAL_RANK", "3")
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert hd.machine_memory_bytes() == host + 80 * 2**30
    assert asked == [3]


def test_the_host_link_bound_comes_from_the_driver_s_pcie_figures(monkeypatch):
    import types

    monkeypatch.setattr(hd, "accelerator_type", lambda: "cuda")
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 2)
    asked = []
    monkeypatch.setattr(hd.subprocess, "run", lambda cmd, **kw: asked.append(cmd) or
                        types.SimpleNamespace(stdout="5, 16\n"))
    assert hd.host_link_bytes_per_s() == pytest.approx(3.938e9 * 16)  # PCIe 5.0 x16: ~63 GB/s
    assert "--id=2" in asked[0]

    def missing(cmd, **kw):
        raise FileNotFoundError("nvidia-smi")
    monkeypatch.setattr(hd.subprocess, "run", missing)
    assert hd.host_link_bytes_per_s() is None
    monkeypatch.setattr(hd, "accelerator_type", lambda: None)
    assert hd.host_link_bytes_per_s() is None
