"""A host-homed parameter lent to an accelerator partition every forward is pinned once per
version of its values, not on every forward (issue 24, finding 14).

No accelerator here: pinning is emulated (``can_pin`` true, ``pin_memory`` a counted copy) and
the meta device plays the accelerator, so the boundary copy takes its host→device route.
"""

from __future__ import annotations

import weakref

import pytest
import torch

import foundation.device as hd
from hetero.optim import OffloadAdamW
from hetero.placement.transfer import to_device

DEVICE = torch.device("meta")


@pytest.fixture
def pins(monkeypatch):
    pinned: set[int] = set()
    made: list[int] = []

    def pin_memory(self, *args, **kwargs):
        copy = self.clone()
        pinned.add(copy.data_ptr())
        # forgotten when freed: a later tensor at the same address is not pinned (the
        # allocator reuses addresses: glibc's MALLOC_PERTURB_ run made this test see one)
        weakref.finalize(copy, pinned.discard, copy.data_ptr())
        made.append(copy.numel())
        return copy
    monkeypatch.setattr(hd, "can_pin", lambda: True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: self.data_ptr() in pinned)
    return made


def test_a_host_parameter_is_pinned_once_per_version(pins):
    table = torch.nn.Parameter(torch.randn(10, 4))
    for _ in range(3):  # three forwards
        assert to_device(table, DEVICE).device == DEVICE
    assert len(pins) == 1
    with torch.no_grad():
        table.add_(1.0)  # an optimizer step
    to_device(table, DEVICE)
    to_device(table, DEVICE)
    assert len(pins) == 2
    table.data = torch.randn(10, 4)  # new storage
    to_device(table, DEVICE)
    assert len(pins) == 3


def test_host_updates_of_the_offloaded_optimizer_are_seen(pins):
    """OffloadAdamW updates a host parameter in place through ``.data``: it must count the
    write, or the next forward would ship the old weights."""
    table = torch.nn.Parameter(torch.randn(10, 4))
    opt = OffloadAdamW([table], lr=0.1, kernel="torch")
    to_device(table, DEVICE)
    table.grad = torch.ones_like(table)
    opt.step()
    to_device(table, DEVICE)
    assert len(pins) == 2


def test_activations_are_not_cached(pins):
    x = torch.randn(3, 4)
    to_device(x, DEVICE)
    to_device(x, DEVICE)
    assert len(pins) == 2  # a fresh pinned copy each time: values that live one forward
