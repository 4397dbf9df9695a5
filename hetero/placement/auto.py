"""``hetero.auto_place``: choose which modules go to the CPU so the device's share fits a budget.

The reference design leaves placement to the user; here a cost model decides. From one meta
capture every node gets its output bytes (shapes from fake tensors; views and in-place results
alias their input and add nothing) and FLOPs (torch's ``FlopCounterMode`` on those fake tensors).
The device's memory is modelled as parameters and buffers homed there (trainable parameters
twice: weight and gradient) plus the activations its ops produce (an upper bound of what autograd
saves) plus copies of host tensors its ops read. The step time is modelled as FLOPs × 3 (forward
+ backward) at each device's rate plus bytes crossing the link twice (activations forward,
gradients back).

Candidates are every module that runs operations or owns parameters, parameter-free ones
included (attention cores, activations); moving one tags it "cpu", exactly as ``set_device``
would, so the plan that ``place`` builds is the plan that was costed. The model's own ops (the
loss it computes in forward) are one more candidate, "<root ops>", moved without its children.
Each round, if some candidate alone meets the budget, the one that slows the step least (then
moves least) is taken and the search ends; otherwise the one that frees the most device bytes
per second of modelled slowdown moves and the search goes on. Memory-heavy,
compute-light modules (embedding tables) go first.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable

from torch import fx, nn
from torch.utils.flop_counter import FlopCounterMode

from foundation import device as hd
from hetero.placement.assign import Assignment, _TagIndex, assign, tensor_homes
from hetero.placement.capture import capture
from hetero.placement.placed import PlacedModule, check_signature
from hetero.placement.split import _nbytes
from hetero.placement.subgraphs import op_schema
from hetero.tags import ANNOTATION_KEY


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


def _out_bytes(node: fx.Node) -> int:
    """Bytes ``node`` allocates: none for views and in-place results (they alias an input)."""
    schema = op_schema(node)
    if schema is not None and any(r.alias_info is not None for r in schema.returns):
        return 0
    return _nbytes(node)


class _CostModel:
    def __init__(self, gm: fx.GraphModule, model: nn.Module, a: Assignment, rates: Rates) -> None:
        self.model, self.rates = model, rates
        self.tags = _TagIndex(model, "device", {})
        self.trainable = {n for n, p in model.named_parameters(remove_duplicate=False)
                          if p.requires_grad}
        self.nodes = [(n, a.node_module[n], (n.meta.get("custom") or {}).get(ANNOTATION_KEY))
                      for n in a.node_device]
        self.bytes = {n: _nbytes(n) for n in gm.graph.nodes}
        self.out_bytes = {n: _out_bytes(n) for n in a.node_device}
        self.flops = {n: _flops(n) for n in a.node_device}
        self.candidates = sorted({m for _, m, _ in self.nodes} | {
            name.rpartition(".")[0] for name, _ in model.named_parameters()})
        self.candidates = [c for c in self.candidates if self.tags.source(c)[1] is None]

    def tags_with(self, cpu_modules: Iterable[str]) -> _TagIndex:
        """The model's tags plus ``cpu_modules`` on the CPU ("" = the model's own ops only)."""
        tags = copy.copy(self.tags)
        moved = set(cpu_modules)
        tags.own = {**self.tags.own, **dict.fromkeys(moved - {""}, "cpu")}
        tags.ops_only = {"": "cpu"} if "" in moved else {}
        return tags

    def cost(self, cpu_modules: Iterable[str]) -> tuple[int, float]:
        """(device bytes, step seconds) with ``cpu_modules`` tagged "cpu" (children follow
        unless tagged themselves); ValueError if that contradicts a tag on a shared tensor."""
        tags = self.tags_with(cpu_modules)
        home = tensor_homes(self.model, tags)
        node_dev = {n: annotated or tags.for_op(m) for n, m, annotated in self.nodes}
        mem, secs = 0, 0.0
        copied: set[tuple[fx.Node, str]] = set()
        for n, dev in node_dev.items():
            rate = self.rates.device_flops if dev == "device" else self.rates.host_flops
            secs += 3 * self.flops[n] / rate
            if dev == "device":
                mem += self.out_bytes[n]
            for i in n.all_input_nodes:
                src = node_dev.get(i) or (home.get(i.target, dev) if i.op == "get_attr" else dev)
                if src != dev and (i, dev) not in copied:
                    copied.add((i, dev))
                    secs += 2 * self.bytes[i] / self.rates.link_bytes_per_s
                    mem += self.bytes[i] if dev == "device" else 0
        for node in self.bytes:
            if node.op == "get_attr" and home.get(node.target) == "device":
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

    Existing ``set_device`` tags are kept (a module tagged "device" stays there); every untagged
    module is a candidate, and so are the model's own ops. Raises ``ValueError`` naming the
    smallest feasible budget when it cannot be met.
    """
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    kwargs = example_kwargs or {}
    if not isinstance(device_memory_budget, int) or device_memory_budget <= 0:
        raise ValueError(f"device_memory_budget must be a positive int of bytes, "
                         f"got {device_memory_budget!r}")
    cm, _ = _cost_model(model, example_inputs, kwargs, rates)
    chosen: list[str] = []
    mem, secs = cm.cost(chosen)
    while mem > device_memory_budget:
        moves = []
        for c in cm.candidates:
            if c in chosen or any(c.startswith(f"{x}.") for x in chosen if x):
                continue
            try:
                m2, s2 = cm.cost([*chosen, c])
            except ValueError:  # it would contradict a tag on a tensor it shares
                continue
            if m2 < mem:
                moves.append((c, m2, s2))
        if not moves:
            raise ValueError(
                f"device_memory_budget={device_memory_budget} bytes cannot be met: the smallest "
                f"feasible budget is {mem} bytes (modelled with {len(chosen)} module(s) on the "
                f"CPU: {', '.join(c or '<root ops>' for c in chosen) or 'none'})"
            )
        enough = [mv for mv in moves if mv[1] <= device_memory_budget]
        if enough:  # finish with the cheapest move that suffices, moving as little as possible
            c, mem, secs = min(enough, key=lambda mv: (mv[2], -mv[1]))
        else:  # else free the most bytes per second of slowdown
            c, mem, secs = max(moves, key=lambda mv: ((mem - mv[1]) / max(mv[2] - secs, 1e-12),
                                                      mem - mv[1]))
        chosen.append(c)
    modules = dict(model.named_modules())
    placed = PlacedModule(model, "device", overrides={modules[c]: "cpu" for c in chosen if c},
                          ops_only={"": "cpu"} if "" in chosen else None)
    placed.capture(example_inputs, kwargs)
    placed.plan.notes.append(
        f"auto_place: {len(chosen)} module(s) on the CPU "
        f"({', '.join(c or '<root ops>' for c in chosen) or 'none'}); "
        f"modelled device bytes {mem} <= budget {device_memory_budget}; modelled step {secs:.2e} s")
    return placed
