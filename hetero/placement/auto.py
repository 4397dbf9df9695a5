"""``hetero.auto_place``: choose which modules go to the CPU so the device's share fits a budget.

The reference design leaves placement to the user; here a cost model decides. From one meta
capture every node gets its output bytes (shapes from fake tensors) and FLOPs (torch's
``FlopCounterMode`` on those fake tensors). The device's memory is modelled as parameters and
buffers homed there (trainable parameters twice: weight and gradient) plus the activations its
ops produce (an upper bound of what autograd saves) plus copies of host parameters its ops read.
The step time is modelled as FLOPs × 3 (forward + backward) at each device's rate plus bytes
crossing the link twice (activations forward, gradients back). Candidates are the modules that own
parameters; greedily, the one that frees the most device bytes per second of modelled slowdown
moves to the CPU, until the budget is met. Memory-heavy, compute-light modules (embedding tables)
go first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from torch import fx, nn
from torch.utils.flop_counter import FlopCounterMode

from hetero import device as hd
from hetero.placement.assign import Assignment, assign
from hetero.placement.capture import capture
from hetero.placement.placed import PlacedModule, check_signature
from hetero.placement.split import _nbytes


@dataclasses.dataclass(frozen=True)
class Rates:
    """Throughputs the cost model assumes (FLOP/s per device, bytes/s over the host link)."""

    host_flops: float = 2e11
    device_flops: float = 5e13
    link_bytes_per_s: float = 2e10

    @classmethod
    def for_this_machine(cls) -> Rates:
        """With no accelerator the "device" is the host: same rate, and copies cost nothing."""
        if hd.has_accelerator():
            return cls()
        return cls(device_flops=cls.host_flops, link_bytes_per_s=float("inf"))


def _flops(node: fx.Node) -> int:
    args = fx.node.map_arg(node.args, lambda n: n.meta.get("val"))
    kwargs = fx.node.map_arg(node.kwargs, lambda n: n.meta.get("val"))
    with FlopCounterMode(display=False) as counter:
        node.target(*args, **kwargs)
    return counter.get_total_flops()


class _CostModel:
    def __init__(self, gm: fx.GraphModule, model: nn.Module, a: Assignment, rates: Rates) -> None:
        self.a, self.rates = a, rates
        self.trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        self.nodes = list(a.node_device)
        self.bytes = {n: _nbytes(n) for n in gm.graph.nodes}
        self.flops = {n: _flops(n) for n in self.nodes}

    def cost(self, cpu_modules: Iterable[str]) -> tuple[int, float]:
        """(device bytes, step seconds) with ``cpu_modules`` (and their children) on the host."""
        prefixes = tuple(cpu_modules)

        def dev_of(path: str, base: str) -> str:
            if base == "device" and any(path == p or path.startswith(p + ".") for p in prefixes):
                return "cpu"
            return base

        node_dev = {n: dev_of(self.a.node_module[n], d) for n, d in self.a.node_device.items()}
        home = {t: dev_of(t.rpartition(".")[0], d) for t, d in self.a.tensor_home.items()}
        mem, secs = 0, 0.0
        for n, dev in node_dev.items():
            rate = self.rates.device_flops if dev == "device" else self.rates.host_flops
            secs += 3 * self.flops[n] / rate
            if dev == "device":
                mem += self.bytes[n]
            for i in n.all_input_nodes:
                src = node_dev.get(i) or (home.get(i.target) if i.op == "get_attr" else dev)
                if src != dev:
                    secs += 2 * self.bytes[i] / self.rates.link_bytes_per_s
                    mem += self.bytes[i] if dev == "device" else 0
        for node in self.bytes:
            if node.op == "get_attr" and home[node.target] == "device":
                mem += self.bytes[node] * (2 if node.target in self.trainable else 1)
        return mem, secs


def _cost_model(model: nn.Module, args: tuple, kwargs: dict, rates: Rates | None
                ) -> tuple[_CostModel, Assignment]:
    check_signature(model, args, kwargs)
    captured = capture(model, args, kwargs)
    a = assign(captured.graph_module, model, "device", {})
    return _CostModel(captured.graph_module, model, a, rates or Rates.for_this_machine()), a


def device_footprint(model: nn.Module, example_inputs: tuple, *,
                     example_kwargs: dict | None = None, cpu_modules: Iterable[str] = ()) -> int:
    """Modelled device bytes of a training step (see module doc), with the model's own tags plus
    ``cpu_modules`` on the host: a starting point for choosing ``device_memory_budget``."""
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    cm, _ = _cost_model(model, example_inputs, example_kwargs or {}, None)
    return cm.cost(list(cpu_modules))[0]


def auto_place(model: nn.Module, example_inputs: tuple, *, device_memory_budget: int,
               example_kwargs: dict | None = None, rates: Rates | None = None) -> PlacedModule:
    """Place ``model`` with the CPU share chosen so the device's modelled bytes fit the budget.

    Existing ``set_device`` tags are kept; untagged modules that own parameters are candidates.
    Raises ``ValueError`` naming the smallest feasible budget when it cannot be met.
    """
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    kwargs = example_kwargs or {}
    if not isinstance(device_memory_budget, int) or device_memory_budget <= 0:
        raise ValueError(f"device_memory_budget must be a positive int of bytes, "
                         f"got {device_memory_budget!r}")
    cm, a = _cost_model(model, example_inputs, kwargs, rates)
    params = dict(model.named_parameters())
    candidates = sorted({name.rpartition(".")[0] for name, home in a.tensor_home.items()
                         if home == "device" and name in params})
    chosen: list[str] = []
    mem, secs = cm.cost(chosen)
    while mem > device_memory_budget:
        best = None
        for c in candidates:
            if c in chosen:
                continue
            m2, s2 = cm.cost([*chosen, c])
            if m2 < mem:
                score = ((mem - m2) / max(s2 - secs, 1e-12), mem - m2)
                best = max(best, (score, c, m2, s2)) if best else (score, c, m2, s2)
        if best is None:
            raise ValueError(
                f"device_memory_budget={device_memory_budget} bytes cannot be met: the smallest "
                f"feasible budget is {mem} bytes (modelled with {len(chosen)} module(s) on the "
                f"CPU: {', '.join(chosen) or 'none'})"
            )
        _, c, mem, secs = best
        chosen.append(c)
    modules = dict(model.named_modules())
    placed = PlacedModule(model, "device", overrides={modules[c]: "cpu" for c in chosen})
    placed.capture(example_inputs, kwargs)
    placed.plan.notes = [
        f"auto_place: {len(chosen)} module(s) on the CPU ({', '.join(chosen) or 'none'}); "
        f"modelled device bytes {mem} <= budget {device_memory_budget}; modelled step {secs:.2e} s"
    ]
    return placed
