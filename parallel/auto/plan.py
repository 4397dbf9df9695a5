"""``parallel.plan_auto_parallel``: plan a model's strategies without applying them and without a
process group (plan a 1024-device job on a laptop), as a :class:`StrategyPlan`.

The plan's ``strategies`` are a plain map (module path, or ``path.attribute`` of a
``parallel.shard`` operator) -> in_strategy, exactly what semi-auto's ``strategies=`` takes, so
applying a plan is semi-auto parallel; ``save``/``load`` write and read it as the YAML of the
recipe's strategy files. ``cost`` is the modelled step time of the forward (compute plus the
communication on every edge), ``breakdown`` the same per operator, ``seconds`` how long the
capture and the search took, ``explain()`` which
operators were annotated, propagated or left data parallel and what each edge communicates.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import yaml
from torch import nn

from parallel.auto import dynamic_programming, recursive_programming
from parallel.auto.cost_model import Comm, DeviceProfile
from parallel.auto.graph import OpNode, capture_ops
from parallel.auto.profile import saved_profile
from parallel.auto.propagate import Decision, edge_comms, propagate
from parallel.semi_auto.registry import MODULE_RULES
from parallel.semi_auto.shard import attach_module_tag, make_module_tag, module_tag
from parallel.semi_auto.strategy_file import match_strategies

SEARCH_MODES = ("sharding_propagation", "dynamic_programming", "recursive_programming")


@dataclasses.dataclass
class PlannedOp:
    """One operator of the plan: its strategy, how it got it, and its collectives: those that
    bring its inputs into that strategy's layouts, then the backward all-reduces of parameter
    gradients its split work leaves partial."""

    name: str
    key: str | None
    rule: str
    strategy: tuple[tuple[int, ...], ...]
    how: str
    comms: list[Comm]
    compute: float
    seconds: float
    memory: float = 0.0


@dataclasses.dataclass
class StrategyPlan:
    """A planned strategy for every operator (see the module docstring)."""

    device_num: int
    ops: list[PlannedOp]
    profile: DeviceProfile
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # capture, search
    search_mode: str = "sharding_propagation"
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def strategies(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        """Module path / operator attribute -> in_strategy, for semi-auto."""
        return {op.key: op.strategy for op in self.ops if op.key is not None}

    @property
    def by_op(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        """Graph operator name (``matmul``, ``add``, ``linear_3``) -> strategy, every operator."""
        return {op.name: op.strategy for op in self.ops}

    @property
    def breakdown(self) -> dict[str, float]:
        return {op.name: op.seconds for op in self.ops}

    @property
    def memory(self) -> float:
        """Modelled bytes per device: parameter slices with their gradients and Adam moments,
        and the activations kept for backward."""
        return sum(op.memory for op in self.ops)

    @property
    def cost(self) -> float:
        """Modelled step time in seconds: every operator's compute, input collectives and
        parameter-gradient all-reduces."""
        return sum(op.seconds for op in self.ops)

    def explain(self) -> str:
        lines = [f"auto parallel plan on {self.device_num} devices ({self.profile.kind} profile, "
                 f"{self.search_mode}): modelled {self.cost * 1e3:.3f} ms, "
                 f"{self.memory / 2**20:.1f} MiB per device", *self.notes]
        for op in self.ops:
            comms = ", ".join(f"{c.kind}{' (backward)' if c.backward else ''} over {c.group} "
                              f"({c.bytes} B)" for c in op.comms)
            where = op.key or "(DTensor)"
            lines.append(f"  {op.name:<16} {where:<24} {op.how:<13} {op.strategy}"
                         f"{'  <- ' + comms if comms else ''}")
        return "\n".join(lines)

    def save(self, path: str | Path) -> Path:
        """The strategies as a strategy-file YAML (module path -> one list per input)."""
        path = Path(path)
        data = {key: [list(entry) for entry in strategy]
                for key, strategy in self.strategies.items()}
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path


def load_plan(path: str | Path) -> dict[str, tuple[tuple[int, ...], ...]]:
    """A saved plan's strategies, ready for ``parallel.parallelize(..., strategies=...)``."""
    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a plan maps module paths to strategies")
    return {key: tuple(tuple(entry) for entry in value) for key, value in data.items()}


def _annotate(model: nn.Module, strategies: dict[str, Any]) -> dict[nn.Module, Any]:
    """``strategies=`` entries (module paths or fnmatch patterns) as module tags, checked against
    each module's rule; returns the tags they replaced, to put back after planning (planning
    changes nothing)."""
    tags = {}
    for path, (module, strategy, out_strategy) in match_strategies(model, strategies).items():
        if not any(isinstance(module, cls) for cls in MODULE_RULES):
            raise ValueError(f"plan_auto_parallel: '{path}' ({type(module).__name__}) has no "
                             f"sharding rule to annotate")
        tags[module] = make_module_tag(module, strategy, out_strategy, f"'{path}'")
    previous = {module: module_tag(module) for module in tags}
    for module, tag in tags.items():
        attach_module_tag(module, tag)
    return previous


def _check_consistent(ops: list[OpNode], decisions: list[Decision]) -> None:
    """A module called at several places must get one strategy."""
    seen: dict[str, tuple[str, Any]] = {}
    for op, decision in zip(ops, decisions, strict=True):
        if op.key is None:
            continue
        strategy = decision.candidate.strategy
        if op.key in seen and seen[op.key][1] != strategy:
            first, other = seen[op.key]
            raise ValueError(f"plan_auto_parallel: '{op.key}' runs as operators '{first}' and "
                             f"'{op.name}', and no one strategy reconciles them: propagation "
                             f"gave {other} and {strategy}; annotate '{op.key}'")
        seen.setdefault(op.key, (op.name, strategy))


def plan_auto_parallel(model: nn.Module, example_inputs: tuple, *, device_num: int,
                       search_mode: str = "sharding_propagation",
                       strategies: dict[str, Any] | None = None,
                       profile: DeviceProfile | None = None,
                       max_device_memory: float | None = None) -> StrategyPlan:
    """Plan ``model``'s strategies on ``device_num`` devices from its annotations
    (``parallel.shard`` tags and ``strategies=``); nothing is applied, no process group needed.
    ``max_device_memory`` (bytes; ``dynamic_programming`` only) bounds each device's modelled
    memory."""
    if search_mode not in SEARCH_MODES:
        raise ValueError(f"plan_auto_parallel: search_mode {search_mode!r} is not one of "
                         f"{SEARCH_MODES}")
    if not isinstance(device_num, int) or device_num < 1 or device_num & (device_num - 1):
        raise ValueError(f"plan_auto_parallel: device_num must be a power of two, got "
                         f"{device_num!r}")
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    profile = profile or saved_profile()  # this machine's, once profile_devices() ran
    previous = _annotate(model, strategies or {})
    start = time.perf_counter()
    try:
        ops = capture_ops(model, example_inputs)
    finally:
        for module, tag in previous.items():
            attach_module_tag(module, tag)
    captured = time.perf_counter()
    notes: list[str] = []
    if max_device_memory is not None and search_mode != "dynamic_programming":
        raise ValueError("plan_auto_parallel: max_device_memory is a constraint of the "
                         "search; use search_mode='dynamic_programming'")
    if search_mode == "dynamic_programming":
        decisions, notes = dynamic_programming.search(ops, device_num, profile,
                                                      max_device_memory)
    elif search_mode == "recursive_programming":
        decisions, notes = recursive_programming.search(ops, device_num, profile)
    else:
        decisions = propagate(ops, device_num, profile)
    seconds = {"capture": captured - start, "search": time.perf_counter() - captured}
    _check_consistent(ops, decisions)
    planned = []
    for op, decision in zip(ops, decisions, strict=True):
        c = decision.candidate
        comms = [comm for k, src in enumerate(op.sources) if src.kind == "op"
                 for comm in edge_comms(op.shapes[k], op.itemsize,
                                        decisions[src.op].candidate.output,
                                        decisions[src.op].candidate.partial, c.inputs[k])]
        comms += list(c.grad_sync)
        planned.append(PlannedOp(op.name, op.key, op.rule.name, c.strategy, decision.how, comms,
                                 c.compute, c.compute + sum(x.time(profile) for x in comms),
                                 c.memory))
    return StrategyPlan(device_num, planned, profile, seconds, search_mode, notes)
