"""The timing loop the multi-rank benchmarks share: warm up, then the median of synced runs.

On an accelerator the host returns from ``fn`` long before the work it queued is done, so the
warm-up's queued work is drained (``synchronize``) before the first timed run — otherwise that run
pays for the warm-up — and each run ends at a synchronize."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import foundation.device as hd
import parallel


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    """Median wall time of ``fn`` in ms; every rank starts each run together (barrier) and the
    device's queued work is included (synchronize)."""
    return interleaved_median_ms({"fn": fn}, repeats, warmup)["fn"]


def interleaved_median_ms(fns: dict[str, Callable[[], object]], repeats: int,
                          warmup: int = 3) -> dict[str, float]:
    """Median wall time in ms of each of ``fns``, run in turns (one run of each per round), so
    a load that drifts during the measurement (a shared machine) hits every variant alike; each
    run starts on every rank together and includes its queued device work."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    hd.synchronize()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            parallel.barrier()
            start = time.perf_counter()
            fn()
            hd.synchronize()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}
