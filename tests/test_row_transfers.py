"""The parameter server ships rows to an accelerator from pinned memory, and device-to-host
copies land in pinned memory and wait for their own event (issue 24, finding 14).

No accelerator here: the meta device plays it for the row shipment (the table stays on the host,
its output goes to "the device"), and the device layer's pinning is recorded."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import foundation.device as hd
import hetero


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_rows_bound_for_the_device_are_received_in_pinned_memory(one_rank, monkeypatch):
    staged: list[tuple] = []
    real = hd.pinned_empty

    def recording(shape, dtype):
        staged.append(tuple(shape))
        return real(shape, dtype)
    monkeypatch.setattr(hd, "pinned_empty", recording)
    table = hetero.nn.EmbeddingLookup(100, 8, sharding="row")
    ids = torch.tensor([[3, 7, 3], [9, 7, 1]])
    host = table(ids)
    assert staged == []  # host output: nothing to stage
    table.output_device = torch.device("meta")
    out = table(ids)
    assert out.device.type == "meta" and out.shape == host.shape
    assert staged == [(4, 8)]  # the 4 distinct rows, once


class _Event:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def record(self, stream=None) -> None:
        self.log.append("record")

    def synchronize(self) -> None:
        self.log.append("synchronize")


def test_device_to_host_copies_land_pinned_and_wait_for_their_event(monkeypatch):
    """An accelerator tensor is emulated by one whose ``device`` says so."""
    log: list[str] = []
    monkeypatch.setattr(hd, "new_event", lambda device="device": _Event(log))
    monkeypatch.setattr(hd, "pinned_empty",
                        lambda shape, dtype: (log.append("pinned"), torch.empty(shape,
                                                                                 dtype=dtype))[1])
    source = torch.arange(6.0)

    class OnDevice(torch.Tensor):
        @property
        def device(self):
            return torch.device("meta")
    fake = source.as_subclass(OnDevice)
    host, done = hd.to_host_async(fake)
    assert log == ["pinned", "record"]
    done.synchronize()
    assert log[-1] == "synchronize"
    assert torch.equal(host.as_subclass(torch.Tensor), source)
