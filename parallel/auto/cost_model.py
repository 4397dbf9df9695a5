"""The cost model automatic parallel plans with: compute, communication and memory per strategy.

Times are seconds on one device, from a :class:`DeviceProfile`:

* compute: an operator's FLOPs divided over the devices that split its work, at ``flops``/s
  (attention at ``attention_flops``/s where measured); an elementwise or normalisation operator
  the profile measured (``elementwise``: seconds per output element of its forward and
  backward) at that rate per element it computes; plus ``dispatch`` seconds per operator, what
  a tensor subclass's (DTensor's) dispatch adds to each, the same whatever the layout;
* communication: each collective by the α-β model of a ring over its group of ``n`` ranks
  (``alpha`` per step, ``bandwidth`` bytes/s per link) — all-reduce ``2(n-1)α + 2(n-1)/n·B/bw``,
  all-gather ``(n-1)α + (n-1)·B/bw`` (B: the shard each rank contributes), reduce-scatter and
  all-to-all ``(n-1)α + (n-1)/n·B/bw`` (B: each rank's input), plus ``collective_call`` per
  collective: what issuing one costs beyond the link (DTensor's redistribute, the functional
  collective's wrapping and wait);
* redistribution: the collectives that turn a tensor's placements into another's, one mesh
  dimension at a time as DTensor's ``redistribute`` does, with ``bytes`` the input each rank
  hands the collective (what the profiler records for it);
* memory: bytes a device holds of a tensor under its placements.

Profiles: :data:`DEFAULT_PROFILES` per logical device ("cpu" for a host-only job, "device" for an
accelerator), or this machine's from :func:`profile_devices` (``parallel.auto.profile``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

import foundation.device as hd
from foundation.atomic_file import write_text_atomic

if TYPE_CHECKING:
    from parallel.auto.cluster import ClusterSpec


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """What one device computes and moves: FLOP/s, collective latency (s), link bytes/s, memory.

    Measured profiles (``profile_devices``) add what a FLOP rate and a link do not say (each
    zero or empty where unmeasured, and then priced as before): ``elementwise``, (ATen operator
    name, seconds per output element of its forward and backward) pairs; ``attention_flops``,
    the FLOP/s of fused attention's forward and backward; ``dispatch``, seconds a tensor
    subclass's dispatch adds per planned operator and step (forward and backward); and
    ``collective_call``, seconds per collective beyond its α-β time; ``host_bandwidth``, the
    device-host link (activation offload's price)."""

    kind: str
    flops: float
    alpha: float
    bandwidth: float
    memory: float
    elementwise: tuple[tuple[str, float], ...] = ()
    attention_flops: float = 0.0
    dispatch: float = 0.0
    collective_call: float = 0.0
    #: bytes/s between the device and host memory, each direction (0: unknown: activation
    #: offload is not priced, so the memory model never chooses it)
    host_bandwidth: float = 0.0

    def __post_init__(self) -> None:
        """Every number finite, FLOP/s, bandwidth and memory positive, the rest >= 0: a saved
        profile with a wrong value fails on load, not inside a planner's search."""
        for field in ("flops", "alpha", "bandwidth", "memory", "attention_flops", "dispatch",
                      "collective_call", "host_bandwidth"):
            _check_number(f"DeviceProfile.{field}", getattr(self, field),
                          positive=field in ("flops", "bandwidth", "memory"))
        for name, rate in self.elementwise:
            _check_number(f"DeviceProfile.elementwise[{name!r}]", rate, positive=False)

    def element_seconds(self, target: str) -> float | None:
        """Seconds per output element of ``target``'s forward and backward, if measured."""
        return dict(self.elementwise).get(target)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(DeviceProfile)}
        data["elementwise"] = {name: float(rate) for name, rate in self.elementwise}
        # every rank may save to the same path: a reader never sees it half-written
        return write_text_atomic(path, yaml.safe_dump(data, sort_keys=False))

    @classmethod
    def load(cls, path: str | Path) -> DeviceProfile:
        """A saved profile; one saved before the measured terms existed loads without them."""
        data = yaml.safe_load(Path(path).read_text())
        fields = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING}
        if not isinstance(data, dict) or not required <= set(data) <= fields:
            raise ValueError(f"{path}: a device profile holds {sorted(required)}, and may hold "
                             f"{sorted(fields - required)}")
        try:
            if "elementwise" in data:
                data["elementwise"] = tuple(sorted((data["elementwise"] or {}).items()))
            return cls(**data)
        except (ValueError, TypeError, AttributeError) as err:
            raise ValueError(f"{path}: {err}") from None


def _check_number(name: str, value: object, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be a finite number")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{name}={value!r} must be {'> 0' if positive else '>= 0'}")


#: Rough defaults: a few host cores over shared memory; a datacenter accelerator over its links.
DEFAULT_PROFILES = {
    "cpu": DeviceProfile("cpu", flops=5e10, alpha=3e-5, bandwidth=5e9, memory=16 * 2**30),
    "device": DeviceProfile("device", flops=2e14, alpha=1e-5, bandwidth=1e11, memory=80 * 2**30),
}


def default_profile() -> DeviceProfile:
    """The default profile of this machine's device kind."""
    return DEFAULT_PROFILES["device" if hd.has_accelerator() else "cpu"]


@dataclasses.dataclass(frozen=True)
class ClusterProfile(DeviceProfile):
    """A :class:`DeviceProfile` whose collectives are priced on a two-level ``cluster``
    (``ClusterSpec``: a group inside a node at the intra-node links, across nodes at the
    inter-node ones, hierarchically when it spans both) instead of one flat link: what the
    per-operator searches price with when planning for a cluster
    (``ClusterSpec.device_profile``)."""

    cluster: ClusterSpec | None = dataclasses.field(default=None, compare=False)

    def save(self, path: str | Path) -> Path:
        raise ValueError("a ClusterProfile is derived from its ClusterSpec; save the "
                         "ClusterSpec's YAML instead")


@dataclasses.dataclass(frozen=True)
class Comm:
    """One collective: ``kind``, ranks in its group, input bytes per rank; ``backward`` for the
    one autograd runs in the backward pass. ``axes`` says where the group's ranks sit: (size,
    rank stride) of each device-matrix axis it spans (row-major ranks; empty: consecutive
    ranks), which a :class:`ClusterProfile` prices by node."""

    kind: str
    group: int
    bytes: int
    backward: bool = False
    axes: tuple[tuple[int, int], ...] = ()

    def time(self, profile: DeviceProfile) -> float:
        n, b = self.group, self.bytes
        if n == 1:
            return 0.0
        cluster = getattr(profile, "cluster", None)
        if cluster is not None:
            group = cluster.placed(n, self.axes)
            if self.kind == "all_reduce":
                return cluster.all_reduce(b, group)
            if self.kind == "all_gather":  # b: each rank's shard; the result is n of them
                return cluster.all_gather(n * b, group)
            return cluster.reduce_scatter(b, group)  # reduce-scatter, all-to-all: b per rank
        steps, volume = {"all_reduce": (2 * (n - 1), 2 * (n - 1) / n * b),
                         "all_gather": (n - 1, (n - 1) * b),
                         "reduce_scatter": (n - 1, (n - 1) / n * b),
                         "all_to_all": (n - 1, (n - 1) / n * b)}[self.kind]
        return steps * profile.alpha + volume / profile.bandwidth + profile.collective_call


def local_shape(shape: Sequence[int], mesh: Sequence[int],
                placements: Sequence[Placement]) -> list[int]:
    """Per-device shape of a tensor under ``placements`` (ceil division, as DTensor pads)."""
    local = list(shape)
    for size, p in zip(mesh, placements, strict=True):
        if isinstance(p, Shard):
            local[p.dim] = math.ceil(local[p.dim] / size)
    return local


def redistribution(shape: Sequence[int], itemsize: int, mesh: Sequence[int],
                   src: Sequence[Placement], dst: Sequence[Placement],
                   kind: str = "device") -> list[Comm]:
    """The collectives that move a tensor from ``src`` to ``dst`` placements.

    Mesh dimensions whose source is sharded or partial and whose target differs are resolved
    innermost first (gathers, reductions); the rest is local slicing, which costs nothing. A
    shard that changes dimension is one all-to-all, except on a host mesh (``kind="cpu"``),
    where gloo has no all-to-all for DTensor and it all-gathers the shard instead."""
    current = list(src)
    comms: list[Comm] = []

    def nbytes() -> int:
        return math.prod(local_shape(shape, mesh, current)) * itemsize
    for i in reversed(range(len(mesh))):
        s, d = current[i], dst[i]
        if s == d:
            continue
        if isinstance(s, Shard) and isinstance(d, Shard):
            comms.append(Comm("all_gather" if kind == "cpu" else "all_to_all", mesh[i],
                              nbytes()))
        elif isinstance(s, Shard):  # to Replicate (or Partial: gather, then keep a share)
            comms.append(Comm("all_gather", mesh[i], nbytes()))
        elif isinstance(s, Partial):
            comms.append(Comm("reduce_scatter" if isinstance(d, Shard) else "all_reduce",
                              mesh[i], nbytes()))
        else:
            continue  # Replicate -> Shard / Partial: a local slice or share
        current[i] = d
    return [c for c in comms if c.group > 1]


def redistribution_time(comms: Sequence[Comm], profile: DeviceProfile) -> float:
    return sum(c.time(profile) for c in comms)


def replicated(mesh: Sequence[int]) -> tuple[Placement, ...]:
    return tuple(Replicate() for _ in mesh)
