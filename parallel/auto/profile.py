"""``parallel.profile_devices()``: measure this machine's device and links for the cost model.

Compute: the median rate of square matmuls (``size`` × ``size``, float32) on the device this
process drives. Links: with a process group of more than one rank, all-reduces of a small and a
large tensor (``link_bytes``) give the α-β model's latency and bandwidth by the ring formula (the
two unknowns of two measurements); in a single process the link figures of the default profile
are kept. In a process group every timed run starts on every rank together (a barrier), as a
training step's do, so a rank's collective does not also count the time its peers spent on what
came before, and its matmuls run beside every other rank's; the ranks' figures are averaged, so
every rank saves the same profile. The result is saved as YAML (``path``, by default in
``$HETERO_PARALLEL_CACHE`` or ``~/.cache/hetero-parallel``), where :func:`saved_profile` finds it.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

import foundation.device as hd
from parallel.auto.cost_model import DeviceProfile, default_profile


def _profile_path() -> Path:
    root = Path(os.environ.get("HETERO_PARALLEL_CACHE", "~/.cache/hetero-parallel"))
    return root.expanduser() / f"device-profile-{default_profile().kind}.yaml"


def _median_seconds(fn: Callable[[], object], repeats: int, together: bool = False) -> float:
    """Median seconds of ``fn``; ``together``: each run started on every rank together (a
    barrier before it), as in a training step: its collectives start once every rank has
    computed its input, and its compute runs beside every other rank's (4 ranks on 2 cores:
    half a core each)."""
    fn()
    times = []
    for _ in range(repeats):
        if together:
            dist.barrier()
        hd.synchronize()
        start = time.perf_counter()
        fn()
        hd.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _link(small: int, large: int, repeats: int) -> tuple[float, float]:
    """(alpha, bandwidth) of the world group from all-reduces of ``small`` and ``large`` bytes.

    Each is timed from a barrier: unsynchronised, a rank's all-reduce also waited for peers
    still busy with what came before (on 2 ranks sharing 2 busy cores this read α as 1.9 ms,
    where a synchronised 768-byte all-reduce took 0.55 ms in all)."""
    n, device = dist.get_world_size(), hd.resolve("device")
    measured = []
    for size in (small, large):
        tensor = torch.ones(size // 4, device=device)
        measured.append(_median_seconds(lambda t=tensor: dist.all_reduce(t), repeats,
                                        together=True))
    steps = 2 * (n - 1)
    factor = 2 * (n - 1) / n
    per_byte = max((measured[1] - measured[0]) / (factor * (large - small)), 1e-15)
    alpha = max((measured[0] - factor * small * per_byte) / steps, 0.0)
    return alpha, 1.0 / per_byte


def profile_devices(path: str | Path | None = None, *, size: int = 1024,
                    repeats: int = 5,
                    link_bytes: tuple[int, int] = (4096, 16 * 2**20)) -> DeviceProfile:
    """Measure this machine (see the module docstring), save the profile and return it.
    ``link_bytes``: the small and the large all-reduce the link figures come from; give the
    sizes the planned job's collectives have (bandwidth at 16 MB, out of cache, is not that
    of the sub-megabyte messages of a small model's step)."""
    device = hd.resolve("device")
    a = torch.randn(size, size, device=device)
    together = dist.is_initialized() and dist.get_world_size() > 1
    flops = 2 * size**3 / _median_seconds(lambda: a @ a, 2 * repeats - 1 if together else repeats,
                                          together)
    profile = dataclasses.replace(default_profile(), flops=flops)
    if together:
        alpha, bandwidth = _link(*link_bytes, 2 * repeats - 1)
        # one profile for the job: every rank plans from it, and plans must agree
        agreed = torch.tensor([flops, alpha, bandwidth], device=device)
        dist.all_reduce(agreed)
        flops, alpha, bandwidth = (agreed / dist.get_world_size()).tolist()
        profile = dataclasses.replace(profile, flops=flops, alpha=alpha, bandwidth=bandwidth)
    if device.type != "cpu":
        profile = dataclasses.replace(profile, memory=float(
            torch.accelerator.get_memory_info(device)[1]))
    profile.save(Path(path) if path is not None else _profile_path())
    return profile


def saved_profile() -> DeviceProfile:
    """The profile :func:`profile_devices` saved for this device kind, else the default."""
    path = _profile_path()
    return DeviceProfile.load(path) if path.exists() else default_profile()
