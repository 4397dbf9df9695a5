"""In-place writes under hetero.place: every write lands on the real tensor, ordered as in eager,
whichever partition reads it; a write an explicit tag would send to a copy is refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hetero


class ShiftRight(nn.Module):
    """HuggingFace's ``shift_tokens_right``: a fresh tensor written in place, read on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(10, 8), nn.Linear(8, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        shifted = ids.new_zeros(ids.shape)
        shifted[:, 1:] = ids[:, :-1].clone()
        shifted[:, 0] = 3
        return self.head(self.embed(shifted))


class RowSum(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.sum(-1, keepdim=True)  # reads h without saving it for backward


class ReadThenWrite(nn.Module):
    """A host reader of ``h`` that comes before a device write into ``h`` must see the old value."""

    def __init__(self) -> None:
        super().__init__()
        self.host, self.dev = RowSum(), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        before = self.host(h)
        h.mul_(10)
        return before * self.dev(h)


class MasksLabels(nn.Module):
    """Writes into its input (``labels[labels == 0] = -100``), then a host module reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(10, 8), nn.Linear(8, 10)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        labels[labels == 0] = 9
        logits = self.head(self.embed(labels.clamp(min=0)) + self.embed(ids))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _placed_and_reference(factory, tag):
    torch.manual_seed(0)
    model = factory()
    reference = copy.deepcopy(model)
    tag(model)
    return hetero.place(model), reference


def _same_grads(placed, reference):
    for (name, p), (_, r) in zip(placed.named_parameters(), reference.named_parameters(),
                                 strict=True):
        torch.testing.assert_close(p.grad.cpu(), r.grad, msg=name)


def test_write_into_an_intermediate_read_on_the_host_matches_eager_every_call():
    placed, reference = _placed_and_reference(ShiftRight,
                                              lambda m: hetero.set_device(m.embed, "cpu"))
    ids = torch.randint(0, 10, (4, 6))
    for _ in range(5):  # a race would show up as call-to-call differences
        torch.testing.assert_close(placed(ids).cpu(), reference(ids))
    placed(ids).sum().backward()
    reference(ids).sum().backward()
    _same_grads(placed, reference)
    host = placed.plan.on("cpu")
    assert len(host) == 1 and host[0].modules == ["embed"]
    # every write into `shifted` runs before the host partition that reads it
    writer = next(p for p in placed.plan if any(n.startswith("copy_") for n in p.nodes))
    assert writer.index in host[0].depends_on or writer is host[0]


def test_a_host_read_before_a_device_write_sees_the_old_value():
    placed, reference = _placed_and_reference(ReadThenWrite,
                                              lambda m: hetero.set_device(m.host, "cpu"))
    x = torch.randn(3, 8)
    for _ in range(3):
        torch.testing.assert_close(placed(x).cpu(), reference(x))
    placed(x).sum().backward()
    reference(x).sum().backward()
    _same_grads(placed, reference)
    host = placed.plan.on("cpu")[0]
    writer = next(p for p in placed.plan if any(n.startswith("mul_") for n in p.nodes))
    assert host.index in writer.depends_on  # the write waits for the earlier host reader


def test_a_write_into_an_input_updates_the_callers_tensor_and_trains():
    placed, reference = _placed_and_reference(MasksLabels,
                                              lambda m: hetero.set_device(m.embed, "cpu"))
    ids = torch.randint(0, 10, (2, 5))
    labels = torch.tensor([[0, 1, 2, 0, 4], [5, 0, 7, 8, 0]])
    mine, theirs = labels.clone(), labels.clone()
    loss, ref_loss = placed(ids, mine), reference(ids, theirs)
    torch.testing.assert_close(loss.cpu(), ref_loss)
    assert torch.equal(mine, theirs) and not torch.equal(mine, labels)  # as eager: mutated
    loss.backward()
    ref_loss.backward()
    _same_grads(placed, reference)


class TaggedWrite(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.host_add_ = hetero.set_device(torch.Tensor.add_, "cpu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        self.host_add_(h, 1.0)
        return h


def test_an_op_tag_that_would_write_into_a_copy_is_refused_by_name():
    model = TaggedWrite()
    with pytest.raises(ValueError, match=r"writes in place into 'linear', which lives on device, "
                                         r"but an op/scope tag places it on cpu"):
        hetero.place(model, (torch.randn(2, 4),))
    assert model.lin.weight.device == hetero.device.resolve("device")
