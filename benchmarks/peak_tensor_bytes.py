"""The peak bytes of tensor storage a block of code allocates on the host, above where it began.

Unlike the resident set (``peak_rss.py``), this counts what the code itself holds: every storage
torch's CPU allocator hands out or takes back inside the block, as torch's profiler records it
(``profile_memory=True``: one ``[memory]`` event per allocation, positive, and per release,
negative). Their running sum's highest point is the peak. It does not depend on glibc's
thresholds, on pages the allocator keeps mapped from earlier work, or on what else runs on the
machine, so a test may assert it tightly; RSS ceilings belong in benchmarks.

A file mapped as a storage (``torch.UntypedStorage.from_file``: safetensors maps a whole weights
file that way) is reported as an allocation of the file's size too, though it is page cache, not
memory the code holds: its allocation and release are left out (matched by size, the file's
exact byte count).

What it does not see: allocations on threads the profiler does not follow (a Python thread of
the code's own), memory outside torch's allocator (Python objects). The set-up and loading paths
measured with it run on the calling thread.

    with PeakTensorBytes() as peak:
        build()
    print(peak.bytes)   # the highest tensor bytes held inside, above the entry
"""

from __future__ import annotations

from collections import Counter
from types import TracebackType
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


class PeakTensorBytes:
    """Context manager: ``bytes`` is the peak of host tensor bytes allocated inside it and not
    yet released (0 when it only released), ``net`` what is still held at its end, ``mapped``
    the bytes of the files mapped as storages inside it (left out of both)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.net = 0
        self.mapped = 0
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._maps: list[int] = []
        self._from_file: Any = None

    def __enter__(self) -> PeakTensorBytes:
        self._from_file = torch.UntypedStorage.from_file
        maps, from_file = self._maps, self._from_file

        def recording(filename: str, shared: bool = False, nbytes: int = 0) -> Any:
            storage = from_file(filename, shared=shared, nbytes=nbytes)
            maps.append(storage.nbytes())
            return storage

        torch.UntypedStorage.from_file = staticmethod(recording)
        self._profile.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._profile.__exit__(kind, err, tb)
        torch.UntypedStorage.from_file = self._from_file
        # kineto_results: the raw events in time order, allocations among them; the public
        # ``events()`` folds them into per-op totals, which lose the order a peak needs
        events = self._profile.profiler.kineto_results.events()
        changes = sorted((e.start_ns(), e.nbytes()) for e in events
                         if e.name() == "[memory]" and e.device_type() == DeviceType.CPU)
        skip = Counter(self._maps) + Counter({-n: c for n, c in Counter(self._maps).items()})
        held = peak = 0
        for _, nbytes in changes:
            if skip[nbytes]:
                skip[nbytes] -= 1
                continue
            held += nbytes
            peak = max(peak, held)
        self.bytes, self.net, self.mapped = peak, held, sum(self._maps)
