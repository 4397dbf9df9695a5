"""Modules that keep their tensors on the host (a host ``EmbeddingLookup``, host-tagged
``GroupedExperts``), built on the meta device and given storage for an accelerator the way
deferred initialization does (``to_empty(device=...)``): their tensors get host storage instead
of staying on the meta device, the rest of the model goes to the device, and deferred init fills
them. Fake CUDA tensors (``FakeTensorMode``) stand in for the accelerator on this machine."""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import hetero
from hetero.nn import EmbeddingLookup
from parallel.nn.experts import GroupedExperts


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = EmbeddingLookup(50, 8, target="CPU")
        self.experts = GroupedExperts(8, 16, 4)
        hetero.set_device(self.experts, "cpu")
        self.head = nn.Linear(8, 50)


def _meta_model() -> _Model:
    """The model on the meta device (an EmbeddingLookup draws its seed when built, so it is
    built with values and then sent to meta, as a model built under torch.device("meta"))."""
    with torch.device("meta"):
        experts = GroupedExperts(8, 16, 4)
    model = _Model()
    model.experts = hetero.set_device(experts, "cpu")
    return model.to_empty(device="meta")


def test_to_empty_for_an_accelerator_gives_host_modules_host_storage():
    model = _meta_model()
    assert all(p.is_meta for p in model.parameters())
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cuda")
        on = {name: (t.device.type, t.is_meta) for name, t in model.named_parameters()}
    assert on["head.weight"] == ("cuda", False)
    for name in ("table.weight", *(f"experts.{n}" for n, _ in model.experts.named_parameters())):
        assert on[name] == ("cpu", False), name
