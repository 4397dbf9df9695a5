"""The peak host memory (resident set) of this process over a block of code, above where it began.

``/proc/self/status``' ``VmHWM`` and ``getrusage``'s ``ru_maxrss`` are high-water marks of the
whole process lifetime and cannot be reset between phases, so a thread samples the RSS every
half millisecond instead (an allocation shorter than that can be missed; the ones measured here
are tensors filled element by element, which last far longer).

    with PeakRSS() as peak:
        build()
    print(peak.bytes)   # the highest RSS seen inside, minus the RSS at entry
"""

from __future__ import annotations

import threading
import time
from types import TracebackType

import psutil


class PeakRSS:
    """Context manager: ``bytes`` is the peak RSS inside it above the RSS at entry."""

    def __init__(self, interval_s: float = 0.0005) -> None:
        self.interval_s = interval_s
        self.bytes = 0
        self.base = 0
        self._proc = psutil.Process()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._done.is_set():
            self.bytes = max(self.bytes, self._proc.memory_info().rss - self.base)
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakRSS:
        self.base = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        self.bytes = max(self.bytes, self._proc.memory_info().rss - self.base)
