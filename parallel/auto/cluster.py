"""``ClusterSpec``: a two-level machine — nodes of devices on fast links (NVLink/NVSwitch, HCCS),
nodes joined by a slower network (InfiniBand/RoCE) — and what collectives cost on it.

A collective's group is priced by where its ranks sit (:class:`Group`): inside one node it runs on
the intra-node links; one rank per node, on the network; a group spanning both runs
hierarchically, as NCCL and HCCL do (a reduce-scatter inside each node, the all-reduce of each
rank's 1/k share across nodes — every device using its own NIC — then an all-gather inside each
node). Times are α-β: ``latency × steps + bytes / bandwidth``, with the ring algorithm's byte
counts (an all-reduce moves ``2 (n-1)/n`` of the buffer through each link).

Bandwidths are per device and per direction (bytes/s): ``intra_bandwidth`` is what one device
pushes into the node's fabric, ``inter_bandwidth`` its share of the node's network adapters.
Presets (``clusters/*.yaml`` beside this file) hold published figures: ``a100-80gb`` (DGX A100:
NVSwitch at 300 GB/s per direction, 8 × 200 Gb/s HDR per node), ``h100-80gb`` (DGX H100: 450 GB/s,
8 × 400 Gb/s NDR), ``ascend-910b`` (HCCS inside an 8-device node, 200 Gb/s RoCE per device), each
with its host tier (memory per node, the PCIe link per device, the host memory's bandwidth), which
the cluster planner may offload optimizer state, weights or activations to.
``matmul_efficiency`` is the fraction of peak FLOP/s large transformer matrix products sustain
(the rest of a step's gap to peak — pipeline bubbles, exposed communication — is priced
separately).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import torch
import yaml

PRESETS = Path(__file__).with_name("clusters")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclasses.dataclass(frozen=True)
class Group:
    """Where a collective's ranks sit: ``size`` ranks, ``per_node`` of them in each node."""

    size: int
    per_node: int

    @property
    def nodes(self) -> int:
        return self.size // self.per_node


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """A cluster of ``nodes`` × ``devices_per_node`` devices (see the module docstring)."""

    nodes: int
    devices_per_node: int
    flops: dict[str, float]  # peak FLOP/s per device, by dtype name ("bfloat16", ...)
    memory: float  # bytes per device
    intra_bandwidth: float  # bytes/s per device and direction, inside a node
    inter_bandwidth: float  # bytes/s per device and direction, across nodes
    intra_latency: float = 5e-6  # seconds per collective step
    inter_latency: float = 1e-5
    hbm_bandwidth: float = 2e12  # device memory bytes/s (the optimizer step streams its state)
    matmul_efficiency: float = 0.5
    name: str = "custom"
    # the host tier (0: unknown, and then nothing is offloaded to it): host memory per node in
    # bytes, the device<->host link per device and direction (PCIe), and the host memory's
    # bandwidth per node (what a host optimizer step streams its state through)
    host_memory: float = 0.0
    host_bandwidth: float = 0.0
    host_memory_bandwidth: float = 0.0

    def __post_init__(self) -> None:
        for field in ("nodes", "devices_per_node"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ClusterSpec.{field} must be a positive int, got {value!r}")
        for field in ("memory", "intra_bandwidth", "inter_bandwidth", "hbm_bandwidth"):
            if not getattr(self, field) > 0:
                raise ValueError(f"ClusterSpec.{field} must be positive, got "
                                 f"{getattr(self, field)!r}")
        for field in ("intra_latency", "inter_latency", "host_memory", "host_bandwidth",
                      "host_memory_bandwidth"):
            if not getattr(self, field) >= 0:
                raise ValueError(f"ClusterSpec.{field} must be >= 0, got {getattr(self, field)!r}")
        if not 0 < self.matmul_efficiency <= 1:
            raise ValueError(f"ClusterSpec.matmul_efficiency must be in (0, 1], got "
                             f"{self.matmul_efficiency!r}")
        if not self.flops or any(k not in _DTYPES or not v > 0 for k, v in self.flops.items()):
            raise ValueError(f"ClusterSpec.flops maps dtype names {sorted(_DTYPES)} to positive "
                             f"FLOP/s, got {self.flops!r}")

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def has_host_tier(self) -> bool:
        """Whether the host's memory and links are known, so state may be offloaded there."""
        return self.host_memory > 0 and self.host_bandwidth > 0 and \
            self.host_memory_bandwidth > 0

    def peak_flops(self, dtype: torch.dtype) -> float:
        """Peak FLOP/s of one device in ``dtype``; KeyError naming the preset's dtypes."""
        name = str(dtype).removeprefix("torch.")
        if name not in self.flops:
            raise KeyError(f"ClusterSpec {self.name!r} has no FLOP/s for {name} (it has "
                           f"{sorted(self.flops)})")
        return self.flops[name]

    # ------------------------------------------------------------------ where groups sit
    def group(self, size: int, stride: int) -> Group:
        """The placement of a group of ``size`` ranks ``stride`` apart (consecutive ranks share
        a node): how many of them fall in one node."""
        if size == 1:
            return Group(1, 1)
        per_node = 1 if stride >= self.devices_per_node else \
            math.gcd(size, max(1, self.devices_per_node // stride))
        return Group(size, per_node)

    def placed(self, size: int, axes: tuple[tuple[int, int], ...]) -> Group:
        """The placement of a group of ``size`` ranks spanning the device-matrix ``axes``
        ((size, rank stride) each; none: consecutive ranks), counted from rank 0: how many of
        them fall in its node."""
        if size == 1:
            return Group(1, 1)
        if not axes or math.prod(n for n, _ in axes) != size:
            return self.group(size, 1)
        offsets = [0]
        for n, stride in axes:
            offsets = [o + i * stride for o in offsets for i in range(n)]
        per_node = sum(1 for o in offsets if o < self.devices_per_node)
        return Group(size, per_node if size % per_node == 0 else 1)

    def device_profile(self, dtype: torch.dtype = torch.bfloat16) -> Any:
        """The cost model profile of one device of this cluster, its collectives priced
        hierarchically (``cost_model.ClusterProfile``): what ``plan_auto_parallel(...,
        cluster=)`` searches with."""
        from parallel.auto.cost_model import ClusterProfile

        return ClusterProfile(kind=f"cluster {self.name}",
                              flops=self.peak_flops(dtype) * self.matmul_efficiency,
                              alpha=self.intra_latency, bandwidth=self.intra_bandwidth,
                              memory=self.memory, host_bandwidth=self.host_bandwidth,
                              cluster=self)

    # ------------------------------------------------------------------ collective times
    def _ring(self, fraction: float, nbytes: float, n: int, bandwidth: float,
              latency: float) -> float:
        return 0.0 if n == 1 else latency * (n - 1) + fraction * (n - 1) / n * nbytes / bandwidth

    def all_reduce(self, nbytes: float, group: Group) -> float:
        """Seconds to all-reduce ``nbytes`` over ``group`` (hierarchical across nodes)."""
        if group.size == 1:
            return 0.0
        k, n = group.per_node, group.nodes
        if n == 1:
            return self._ring(2, nbytes, k, self.intra_bandwidth, self.intra_latency)
        inside = 2 * self._ring(1, nbytes, k, self.intra_bandwidth, self.intra_latency)
        return inside + self._ring(2, nbytes / k, n, self.inter_bandwidth, self.inter_latency)

    def all_gather(self, nbytes: float, group: Group) -> float:
        """Seconds to all-gather a ``nbytes`` result (reduce-scatter costs the same)."""
        if group.size == 1:
            return 0.0
        k, n = group.per_node, group.nodes
        if n == 1:
            return self._ring(1, nbytes, k, self.intra_bandwidth, self.intra_latency)
        return (self._ring(1, nbytes / n, k, self.intra_bandwidth, self.intra_latency)
                + self._ring(1, nbytes, n, self.inter_bandwidth, self.inter_latency))

    reduce_scatter = all_gather

    def all_to_all(self, nbytes: float, group: Group) -> float:
        """Seconds for every rank of ``group`` to send ``1/size`` of its ``nbytes`` to each
        peer (an MoE dispatch or combine): the peers in its node over the node's links, the
        others over its network adapter, both at once."""
        if group.size == 1:
            return 0.0
        k, size = group.per_node, group.size
        inside = (k - 1) * (self.intra_latency + nbytes / size / self.intra_bandwidth)
        outside = (size - k) * (self.inter_latency + nbytes / size / self.inter_bandwidth)
        return max(inside, outside)

    def send(self, nbytes: float, across_nodes: bool) -> float:
        """Seconds for one point-to-point transfer (a pipeline stage boundary)."""
        if across_nodes:
            return self.inter_latency + nbytes / self.inter_bandwidth
        return self.intra_latency + nbytes / self.intra_bandwidth

    # ------------------------------------------------------------------ construction
    def with_nodes(self, nodes: int) -> ClusterSpec:
        return dataclasses.replace(self, nodes=nodes)

    @classmethod
    def from_dict(cls, data: dict[str, Any], name: str = "custom") -> ClusterSpec:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ValueError(f"ClusterSpec {name!r}: unknown keys {unknown}; keys are "
                             f"{sorted(fields)}")
        numbers = {k: _number(name, k, v) if k not in ("nodes", "devices_per_node", "flops",
                                                          "name") else v
                   for k, v in data.items()}
        flops = data.get("flops", {})
        if not isinstance(flops, dict):
            raise ValueError(f"ClusterSpec {name!r}: flops={flops!r} must map dtype names to "
                             f"FLOP/s")
        numbers["flops"] = {k: _number(name, f"flops.{k}", v) for k, v in flops.items()}
        return cls(**{"name": name, **numbers})

    @classmethod
    def from_yaml(cls, path: str | Path) -> ClusterSpec:
        path = Path(path)
        data = yaml.safe_load(path.read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a cluster spec is a mapping of ClusterSpec fields")
        try:
            return cls.from_dict(data, data.pop("name", path.stem))
        except (ValueError, TypeError) as err:  # checked before any planning uses it
            raise ValueError(f"{path}: {err}") from None

    @classmethod
    def preset(cls, name: str, nodes: int = 1) -> ClusterSpec:
        """A shipped preset (``a100-80gb``, ``h100-80gb``, ``ascend-910b``) with ``nodes``
        nodes."""
        path = PRESETS / f"{name}.yaml"
        if not path.is_file():
            raise ValueError(f"unknown cluster preset {name!r}; presets: {preset_names()}")
        return cls.from_yaml(path).with_nodes(nodes)

    @classmethod
    def from_device_profile(cls, profile: Any, devices: int) -> ClusterSpec:
        """One node of ``devices`` devices with the FLOP/s, link and memory this machine
        measured (``parallel.auto.profile_devices()``)."""
        return cls(nodes=1, devices_per_node=devices, flops={"float32": profile.flops,
                   "bfloat16": profile.flops, "float16": profile.flops}, memory=profile.memory,
                   intra_bandwidth=profile.bandwidth, inter_bandwidth=profile.bandwidth,
                   intra_latency=profile.alpha, inter_latency=profile.alpha,
                   hbm_bandwidth=max(profile.bandwidth, 1e9), matmul_efficiency=1.0,
                   name=f"measured-{profile.kind}")


def _number(owner: str, key: str, value: Any) -> float:
    """``value`` as a float, or a ValueError naming ``key`` ("fast" or a list is no number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"ClusterSpec {owner!r}: {key}={value!r} must be a number")
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"ClusterSpec {owner!r}: {key}={value!r} must be a number") from None


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.yaml"))


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending (device counts need not be powers of two)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})
