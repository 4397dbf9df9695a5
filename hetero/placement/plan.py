"""The placement plan: partitions in execution order, and ``explain`` that prints it as a table."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class Partition:
    """One subgraph that runs on one device.

    ``device`` is logical ("cpu" or "device"), so a plan reads the same on every machine;
    ``torch_device`` is what it resolved to here. ``bytes_in`` counts tensors that arrive from
    another device (activations, model inputs, parameters homed elsewhere); ``bytes_out`` counts
    this partition's results that a partition on another device (or the caller) consumes there.
    """

    index: int
    name: str
    device: str
    torch_device: torch.device
    nodes: list[str]
    modules: list[str]
    param_bytes: int
    bytes_in: int
    bytes_out: int
    depends_on: list[int]
    copies_in: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Plan:
    """Partitions in execution order, plus where each parameter and buffer lives."""

    partitions: list[Partition]
    tensor_home: dict[str, str]
    mode: str = "graph"
    notes: list[str] = dataclasses.field(default_factory=list)

    def __iter__(self):
        return iter(self.partitions)

    def __len__(self) -> int:
        return len(self.partitions)

    def __getitem__(self, index: int) -> Partition:
        return self.partitions[index]

    def on(self, device: str) -> list[Partition]:
        """The partitions on logical device ``device``."""
        return [p for p in self.partitions if p.device == device]

    def modules_on(self, device: str) -> set[str]:
        """Module paths with at least one op on ``device``."""
        return {m for p in self.on(device) for m in p.modules}


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _short(items: list[str], limit: int = 4) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", … (+{len(items) - limit})" if len(items) > limit else "")


def explain_plan(plan: Plan) -> str:
    """A readable table of ``plan``: one row per partition, in execution order."""
    header = ("#", "device", "ops", "params", "in (x-dev)", "out (x-dev)", "after", "modules")
    rows = []
    for p in plan.partitions:
        modules = [m or "<root>" for m in p.modules]
        rows.append((
            str(p.index), f"{p.device} ({p.torch_device})", str(len(p.nodes)),
            _fmt_bytes(p.param_bytes), _fmt_bytes(p.bytes_in), _fmt_bytes(p.bytes_out),
            ",".join(map(str, p.depends_on)) or "-", _short(modules),
        ))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [f"placement plan ({plan.mode} mode): {len(plan.partitions)} partition(s)"]
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip())
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    cpu = sorted(n for n, d in plan.tensor_home.items() if d == "cpu")
    if cpu:
        lines.append(f"on the host: {_short(cpu, 6)}")
    return "\n".join(lines + plan.notes)
