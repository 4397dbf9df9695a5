"""Which rank holds the others back: each rank's forward time, compared at every log line
(``trainer.straggler_threshold``).

A synchronous job runs at its slowest rank's pace, and the step time every rank measures is the
same: the fast ranks spend the difference waiting inside the gradient exchange. The forward pass
of data parallel (and of optimizer parallel level1/2) issues no collective, so its time is the
rank's own speed — a throttled or failing device, a busy host, a slower node. Each rank times
its forwards (device events on an accelerator: the stream's time, no extra host wait), and at
each log line the ranks exchange their mean over the window (a small all-gather of host
values on the default group's host backend); when the slowest is more than the threshold
above the median, the log names it and its lag. Under pipeline stages or tensor parallel the
forward holds exchanges too, so the figure includes their waits.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator

import torch
import torch.distributed as dist

import foundation.device as hd
from foundation.compat import all_gather_single


class StragglerWatch:
    """The forwards of this rank since the last check, and the check (module docstring);
    ``threshold``: the lag over the median (0.2: 20 %) from which the slowest rank is named."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.timed: list[tuple[torch.Event | hd.HostEvent, torch.Event | hd.HostEvent]] = []

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Time what runs inside (a forward pass) on this rank."""
        if self.world == 1:
            yield
            return
        start, end = hd.timing_event(), hd.timing_event()
        start.record()
        yield
        end.record()
        self.timed.append((start, end))

    def check(self, step: int) -> str | None:
        """Collective (every rank, at the same steps): the message naming the slowest rank
        when its mean forward since the last check lags the median by more than the threshold,
        else None."""
        if self.world == 1 or not self.timed:
            return None
        self.timed[-1][1].synchronize()
        mine = sum(s.elapsed_time(e) for s, e in self.timed) / len(self.timed)
        count = len(self.timed)
        self.timed.clear()
        everyone = torch.zeros(self.world, dtype=torch.float64)
        all_gather_single(everyone, torch.tensor([mine], dtype=torch.float64))
        times = everyone.tolist()
        median = statistics.median(times)
        slowest = max(range(self.world), key=times.__getitem__)
        lag = times[slowest] / median - 1 if median > 0 else 0.0
        if lag <= self.threshold:
            return None
        return (f"step {step}: rank {slowest} is the slowest, its forward {times[slowest]:.1f} ms "
                f"against the median {median:.1f} ms over the last {count} steps "
                f"(+{lag:.0%}; trainer.straggler_threshold={self.threshold:g}): every rank "
                f"waits for it")
