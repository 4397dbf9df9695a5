"""One placed model driven from several threads gives every call the bits a single thread gets.

A host partition runs on the caller's thread when there is nothing to overlap and on the shared
host worker otherwise, so which thread runs it depends on timing. The intra-op thread count is
per thread (``torch.set_num_threads`` after the worker started does not reach it), and reductions
and matmuls split their work by it: the worker takes the caller's count for each partition
(``foundation.thread_state``), so the result no longer depends on where the partition ran.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

import hetero

THREADS, CALLS = 4, 40
_SEEN: list[int] = []


@torch.library.custom_op("hetero_test::record_num_threads", mutates_args=())
def record_num_threads(x: torch.Tensor) -> torch.Tensor:
    """Records the intra-op thread count of the thread running it."""
    _SEEN.append(torch.get_num_threads())
    return x.clone()


@record_num_threads.register_fake
def _(x):
    return torch.empty_like(x)


class HostBranch(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return record_num_threads(self.down(torch.tanh(self.up(h))))


class Branches(nn.Module):
    """A host branch and a device branch that meet again: host work overlaps device work."""

    def __init__(self, d: int = 96) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.host = HostBranch(d)
        self.dev = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d))
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.norm(h + self.host(h).softmax(-1) * self.dev(h)).sum(0)


def _placed() -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = Branches()
    hetero.set_device(model.host, "cpu")
    placed = hetero.place(model)
    return placed, [torch.randn(64, 96) for _ in range(6)]


def _drive(placed: nn.Module, inputs: list[torch.Tensor], reference: list[torch.Tensor]) -> list:
    differ: list = []

    def calls(t: int) -> None:
        with torch.no_grad():
            for i in range(CALLS):
                k = (t + i) % len(inputs)
                out = placed(inputs[k])
                if not torch.equal(out, reference[k]):
                    differ.append((t, i, (out - reference[k]).abs().max().item()))

    threads = [threading.Thread(target=calls, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    return differ


def test_threads_calling_one_placed_model_get_the_single_threaded_bits():
    placed, inputs = _placed()
    with torch.no_grad():
        reference = [placed(x) for x in inputs]
    assert _drive(placed, inputs, reference) == []


def test_the_host_worker_follows_set_num_threads_called_after_it_started():
    placed, inputs = _placed()
    before = torch.get_num_threads()
    try:
        with torch.no_grad():
            torch.set_num_threads(2)
            placed(inputs[0])  # the worker exists now, with the count of that time
            torch.set_num_threads(1)
            _SEEN.clear()
            reference = [placed(x) for x in inputs]
            assert _drive(placed, inputs, reference) == []
    finally:
        torch.set_num_threads(before)
    assert _SEEN and set(_SEEN) == {1}, _SEEN
