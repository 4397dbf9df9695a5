"""Time the training stream spends waiting for collectives: the "exposed" communication.

A functional collective is issued asynchronously and waited for with
``_c10d_functional.wait_tensor``. On the host (gloo) that wait blocks the thread, so its wall time
is the exposed time. On an accelerator the wait blocks nothing on the host: it makes the current
stream wait for the collective's stream, and the host returns at once, so host time says nothing.
There the exposed time is the stream's own stall: a timing event recorded on the current stream
just before the wait and one just after measure how long the stream sat waiting (the device
layer's ``timing_event``: device events on an accelerator, wall-clock events on the host).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import foundation.device as hd

_WAIT = "_c10d_functional.wait_tensor"


class StreamWaits(TorchDispatchMode):
    """While active, records a timing-event pair around every ``wait_tensor``; ``total_ms``
    (after the timed work) is the time the stream spent in them."""

    def __init__(self) -> None:
        super().__init__()
        self.pairs: list[tuple[Any, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if _WAIT not in str(func):
            return func(*args, **(kwargs or {}))
        device = args[0].device if args and isinstance(args[0], torch.Tensor) else "device"
        start, end = hd.timing_event(device), hd.timing_event(device)
        start.record()
        out = func(*args, **(kwargs or {}))
        end.record()
        self.pairs.append((start, end))
        return out

    def total_ms(self) -> float:
        """Milliseconds of all recorded waits (synchronizes the device first)."""
        hd.synchronize()
        return sum(start.elapsed_time(end) for start, end in self.pairs)


def exposed_ms(fn: Callable[[], object]) -> float:
    """Milliseconds one call of ``fn`` spends waiting for its functional collectives."""
    with StreamWaits() as waits:
        fn()
    return waits.total_ms()
