"""``parallel.plan_auto_parallel``: plan a model's strategies without applying them and without a
process group (plan a 1024-device job on a laptop), as a :class:`StrategyPlan`.

The plan's ``strategies`` are a plain map (module path, or ``path.attribute`` of a
``parallel.shard`` operator) -> in_strategy, exactly what semi-auto's ``strategies=`` takes, so
applying a plan is semi-auto parallel; ``save``/``load`` write and read it as the YAML of the
recipe's strategy files. ``cost`` is the modelled step time of the forward (compute plus the
communication on every edge), ``breakdown`` the same per operator, ``seconds`` how long the
capture and the search took, ``explain()`` which
operators were annotated, propagated or left data parallel and what each edge communicates.
Under ``max_device_memory`` the searches also choose activation recompute per layer
(``recompute_choice``): ``recompute`` says which layers (path -> "selective" / "full"), and the
plan's memory and time count it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from foundation.atomic_file import write_text_atomic
from parallel.auto import dynamic_programming, recursive_programming
from parallel.auto.candidates import OptimizerShards, arriving, edge_comms
from parallel.auto.cluster import ClusterSpec
from parallel.auto.cost_model import Comm, DeviceProfile
from parallel.auto.graph import OpNode, capture_ops, subgraph
from parallel.auto.profile import saved_profile
from parallel.auto.propagate import Decision, propagate
from parallel.auto.recompute_choice import (
    LayerRecompute,
    RecomputeCost,
    fixed_modes,
    stack_layers,
)
from parallel.config import OPTIMIZER_LEVELS, SEARCH_MODES
from parallel.semi_auto.registry import module_rule
from parallel.semi_auto.shard import attach_module_tag, make_module_tag, module_tag
from parallel.semi_auto.strategy_file import match_strategies


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
    memory: float = 0.0  # bytes per device it holds: less its output where recompute drops it
    stage: int = 0  # the pipeline stage running it
    recompute: float = 0.0  # seconds of ``seconds`` its recomputed forward adds


@dataclasses.dataclass
class StrategyPlan:
    """A planned strategy for every operator (see the module docstring)."""

    device_num: int
    ops: list[PlannedOp]
    profile: DeviceProfile
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # capture, search
    search_mode: str = "sharding_propagation"
    notes: list[str] = dataclasses.field(default_factory=list)
    #: layer path -> "selective" / "full" / "offload": the layers the plan recomputes or
    #: offloads (``parallelize`` wraps them with ``parallel.recompute``); the rest keep theirs
    recompute: dict[str, str] = dataclasses.field(default_factory=dict)
    #: layer path -> mode -> what that layer holds, drops and adds under the plan's layouts
    #: (every layer the searches could recompute, every mode: the memory model)
    recompute_costs: dict[str, dict[str, RecomputeCost]] = dataclasses.field(
        default_factory=dict)
    #: stage -> bytes its largest recomputed layer brings back during its backward
    restore: dict[int, float] = dataclasses.field(default_factory=dict)

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
    def stage_memory(self) -> dict[int, float]:
        """Modelled bytes per device of each pipeline stage (one stage without pipeline)."""
        found: dict[int, float] = {}
        for op in self.ops:
            found[op.stage] = found.get(op.stage, 0.0) + op.memory
        for stage, restore in self.restore.items():
            found[stage] = found.get(stage, 0.0) + restore
        return found

    @property
    def memory(self) -> float:
        """Modelled bytes per device (of the fullest pipeline stage): parameter slices with
        their gradients and Adam moments (the share optimizer parallel leaves), and the
        activations kept for backward (less what recompute drops, plus what its largest
        recomputed layer brings back in backward)."""
        return max(self.stage_memory.values(), default=0.0)

    @property
    def host_memory(self) -> float:
        """Modelled bytes per device kept in host memory: the activations of the layers the plan
        offloads (recompute mode ``offload``)."""
        return sum(self.recompute_costs[path]["offload"].saved
                   for path, mode in self.recompute.items() if mode == "offload")

    @property
    def cost(self) -> float:
        """Modelled step time in seconds: every operator's compute, input collectives and
        parameter-gradient all-reduces, and the forwards recompute runs again."""
        return sum(op.seconds for op in self.ops)

    def explain(self) -> str:
        lines = [f"auto parallel plan on {self.device_num} devices ({self.profile.kind} profile, "
                 f"{self.search_mode}): modelled {self.cost * 1e3:.3f} ms, "
                 f"{self.memory / 2**20:.1f} MiB per device"
                 + (f", {self.host_memory / 2**20:.1f} MiB per device in host memory"
                    if self.host_memory else ""), *self.notes]
        if self.recompute:
            added = sum(op.recompute for op in self.ops)
            lines.append(f"  recompute ({added * 1e3:.3f} ms added): " + ", ".join(
                f"{path} {mode}" for path, mode in self.recompute.items()))
        staged = len(self.stage_memory) > 1
        for stage in sorted(self.stage_memory) if staged else ():
            mine = [op for op in self.ops if op.stage == stage]
            lines.append(f"  stage {stage}: modelled {sum(o.seconds for o in mine) * 1e3:.3f} ms, "
                         f"{self.stage_memory[stage] / 2**20:.1f} MiB per device")
        for op in self.ops:
            comms = ", ".join(f"{c.kind}{' (backward)' if c.backward else ''} over {c.group} "
                              f"({c.bytes} B)" for c in op.comms)
            where = op.key or "(DTensor)"
            lines.append(f"  {f'[{op.stage}] ' if staged else ''}{op.name:<16} {where:<24} "
                         f"{op.how:<13} {op.strategy}"
                         f"{'  <- ' + comms if comms else ''}"
                         f"{'  [recomputed]' if op.recompute else ''}")
        return "\n".join(lines)

    def save(self, path: str | Path) -> Path:
        """The strategies as a strategy-file YAML (module path -> one list per input), and the
        layers it recomputes under the key ``recompute`` (layer path -> mode; a mapping, where
        a strategy is a list, so no module path is shadowed)."""
        path = Path(path)
        data: dict[str, Any] = {key: [list(entry) for entry in strategy]
                                for key, strategy in self.strategies.items()}
        if self.recompute:
            data[RECOMPUTE_KEY] = dict(self.recompute)
        # every rank may save to the same path: a reader never sees it half-written
        return write_text_atomic(path, yaml.safe_dump(data, sort_keys=False))


#: the key of a saved plan's recomputed layers (its value a mapping, a strategy's a list)
RECOMPUTE_KEY = "recompute"


def load_plan(path: str | Path) -> dict[str, Any]:
    """A saved plan: its strategies, ready for ``ParallelConfig(strategies=...)``,
    and, under ``recompute``, the layers it recomputes (``plan_recompute`` reads them)."""
    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a plan maps module paths to strategies")
    plan: dict[str, Any] = {}
    for key, value in data.items():
        if key == RECOMPUTE_KEY and isinstance(value, dict):
            bad = {k: v for k, v in value.items() if v not in ("selective", "full")}
            if bad:
                raise ValueError(f"{path}: recompute modes must be 'selective' or 'full', got "
                                 f"{bad}")
            plan[key] = dict(value)
        else:
            plan[key] = tuple(tuple(entry) for entry in value)
    return plan


def plan_recompute(plan: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """(strategies, recomputed layers) of a plan given as a mapping (``load_plan``'s)."""
    strategies = dict(plan)
    recompute = strategies.pop(RECOMPUTE_KEY, {})
    if not isinstance(recompute, Mapping):  # a module named "recompute" with its strategy
        strategies[RECOMPUTE_KEY], recompute = recompute, {}
    return strategies, dict(recompute)


def _annotate(model: nn.Module, strategies: dict[str, Any]) -> dict[nn.Module, Any]:
    """``strategies=`` entries (module paths or fnmatch patterns) as module tags, checked against
    each module's rule; returns the tags they replaced, to put back after planning (planning
    changes nothing)."""
    tags = {}
    for path, (module, strategy, out_strategy) in match_strategies(model, strategies).items():
        if module_rule(module) is None:
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


def stage_of_ops(ops: list[OpNode], stages: Mapping[str, int]) -> list[int]:
    """Each operator's pipeline stage: that of the stage unit (``stages``: unit module path ->
    stage) its module lies in; an operator of the root's own forward runs with the operator
    before it (the first stage at the start)."""
    found, last = [], 0
    for op in ops:
        units = [u for u in stages if op.module == u or op.module.startswith(u + ".")]
        if units:
            last = stages[max(units, key=len)]
        found.append(last)
    return found


def _search(ops: list[OpNode], device_num: int, search_mode: str, profile: DeviceProfile,
            max_device_memory: float | None, shards: OptimizerShards, where: str,
            layouts: dict[str, tuple[int, ...]], recompute: LayerRecompute | None = None
            ) -> tuple[list[Decision], list[str]]:
    if search_mode == "dynamic_programming":
        return dynamic_programming.search(ops, device_num, profile, max_device_memory, shards,
                                          where, layouts, recompute)
    if search_mode == "recursive_programming":
        return recursive_programming.search(ops, device_num, profile, max_device_memory,
                                            shards, where, layouts, recompute)
    return propagate(ops, device_num, profile, shards, layouts), []


def _check_plan_args(search_mode: str, device_num: int, data: int,
                     optimizer_level: str | None, max_device_memory: float | None,
                     recompute: bool) -> None:
    """``plan_auto_parallel``'s refusals, before anything is captured."""
    if search_mode not in SEARCH_MODES:
        raise ValueError(f"plan_auto_parallel: search_mode {search_mode!r} is not one of "
                         f"{SEARCH_MODES}")
    if not isinstance(device_num, int) or device_num < 1 or device_num & (device_num - 1):
        raise ValueError(f"plan_auto_parallel: device_num must be a power of two, got "
                         f"{device_num!r}")
    if not isinstance(data, int) or data < 1 or device_num % data:
        raise ValueError(f"plan_auto_parallel: data={data!r} must be a positive divisor of "
                         f"device_num={device_num}")
    if optimizer_level not in (None, *OPTIMIZER_LEVELS):
        raise ValueError(f"plan_auto_parallel: optimizer_level {optimizer_level!r} is not one "
                         f"of {OPTIMIZER_LEVELS} (or None)")
    if max_device_memory is not None and search_mode == "sharding_propagation":
        raise ValueError("plan_auto_parallel: max_device_memory is a constraint of the "
                         "search; use search_mode='dynamic_programming' or "
                         "'recursive_programming'")
    if not isinstance(recompute, bool):
        raise TypeError(f"plan_auto_parallel: recompute must be True or False (may the searches "
                        f"choose activation recompute per layer), got {recompute!r}")


def _plan_profile(model: nn.Module, device_num: int, profile: DeviceProfile | None,
                  cluster: ClusterSpec | None, dtype: torch.dtype | None) -> DeviceProfile:
    """The devices a plan is priced on: ``cluster``'s at ``dtype`` (default: the model's), else
    ``profile``, else this machine's saved one."""
    if cluster is not None:
        if profile is not None:
            raise ValueError("plan_auto_parallel: give a profile or a cluster, not both (the "
                             "cluster's devices are the profile)")
        if device_num > cluster.devices:
            raise ValueError(f"plan_auto_parallel: device_num={device_num} exceeds the "
                             f"cluster's {cluster.devices} devices")
        if dtype is None:
            dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()),
                         torch.float32)
        profile = cluster.device_profile(dtype)
    return profile or saved_profile()  # this machine's, once profile_devices() ran


def plan_auto_parallel(model: nn.Module, example_inputs: tuple, *, device_num: int,
                       search_mode: str = "sharding_propagation",
                       strategies: dict[str, Any] | None = None,
                       profile: DeviceProfile | None = None,
                       max_device_memory: float | None = None,
                       stages: Mapping[str, int] | None = None,
                       data: int = 1, optimizer_level: str | None = None,
                       cluster: ClusterSpec | None = None,
                       dtype: torch.dtype | None = None,
                       recompute: bool = True) -> StrategyPlan:
    """Plan ``model``'s strategies on ``device_num`` devices from its annotations
    (``parallel.shard`` tags and ``strategies=``); nothing is applied, no process group needed.

    ``max_device_memory`` (bytes; the two searches) bounds each device's modelled memory.
    ``stages`` (module path -> pipeline stage, as ``parallel.pipeline`` splits the model) plans
    each stage's operators on its own ``device_num`` devices, under the limit each, with
    ``example_inputs`` one micro-batch. ``data`` > 1 keeps a data-parallel axis of that many
    devices (the batch split over them, parameters replicated there: what optimizer parallel
    shards, and what ``full_batch=False`` feeds slice by slice), and ``optimizer_level``
    ("level1" to "level3") counts the memory it saves and the weight gathers level3 adds.
    ``cluster`` (a ``ClusterSpec``, instead of ``profile``) prices on its devices: compute at
    its FLOP/s, each collective by where its ranks sit (rank r on node r // devices_per_node;
    a group inside a node at intra-node numbers, across nodes at inter-node ones,
    hierarchically when it spans both), so the searches keep heavy groups inside a node;
    ``dtype`` picks its FLOP/s (default: the model's parameter dtype).

    ``recompute`` (the two searches): the layers of the model's layer stack may take activation
    recompute ("selective" or "full") where the memory limit needs it or it meets the limit more
    cheaply than layouts alone (``recompute_choice``); the plan's ``recompute`` says which, and
    its memory and cost count it. Layers already ``parallel.recompute``'d are counted at their
    mode. False: layouts alone meet the limit."""
    _check_plan_args(search_mode, device_num, data, optimizer_level, max_device_memory,
                     recompute)
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    profile = _plan_profile(model, device_num, profile, cluster, dtype)
    shards = OptimizerShards(data, optimizer_level)
    previous = _annotate(model, strategies or {})
    start = time.perf_counter()
    try:
        ops = capture_ops(model, example_inputs)
    finally:
        for module, tag in previous.items():
            attach_module_tag(module, tag)
    captured = time.perf_counter()
    stage_of = stage_of_ops(ops, stages) if stages else [0] * len(ops)
    decisions: list[Decision | None] = [None] * len(ops)
    searched: list[OpNode | None] = [None] * len(ops)  # as its stage's graph holds it
    notes: list[str] = []
    layouts: dict[str, tuple[int, ...]] = {}  # parameters an earlier stage laid out (ties)
    layers = stack_layers(model) if search_mode != "sharding_propagation" else []
    fixed = fixed_modes(model, layers)
    if not recompute:  # counted at their mode, none chosen
        layers = list(fixed)
    dropped: dict[int, float] = {}  # operator -> output bytes recompute drops
    rerun: dict[int, float] = {}  # operator -> seconds its recomputed forward adds
    chosen: dict[str, str] = {}
    costs: dict[str, dict[str, RecomputeCost]] = {}
    restore: dict[int, float] = {}
    for stage in sorted(set(stage_of)):  # a stage receives its inputs whole: planned apart
        keep = [j for j, s in enumerate(stage_of) if s == stage]
        where = (f"on stage {stage}'s {device_num} devices" if stages
                 else f"on {device_num} devices")
        graph = subgraph(ops, keep)
        layered = LayerRecompute(graph, layers, profile, fixed) if layers else None
        found, found_notes = _search(graph, device_num, search_mode, profile,
                                     max_device_memory, shards, where, layouts, layered or None)
        if layered:
            modes = [layered.modes[p] for p in layered.paths]
            stage_costs = layered.costs(found)
            costs.update(zip(layered.paths, stage_costs, strict=True))
            chosen.update({p: m for p, m in layered.modes.items() if m != "none"})
            restore[stage] = layered.restore(stage_costs, modes)
            less, more = layered.per_op(found, layered.modes)
            dropped.update({keep[i]: b for i, b in less.items()})
            rerun.update({keep[i]: t for i, t in more.items()})
        for j, op, decision in zip(keep, graph, found, strict=True):
            decisions[j], searched[j] = decision, op
            for k, src in enumerate(ops[j].sources):
                if src.kind == "param":
                    layouts.setdefault(src.param, decision.candidate.inputs[k])
        notes += [f"stage {stage}: {n}" if stages else n for n in found_notes]
    seconds = {"capture": captured - start, "search": time.perf_counter() - captured}
    _check_consistent(ops, decisions)
    planned = []
    for j, (op, decision) in enumerate(zip(ops, decisions, strict=True)):
        c = decision.candidate
        comms = [comm for k, src in enumerate(op.sources)
                 if src.linked and stage_of[src.op] == stage_of[j]
                 for comm in edge_comms(op.shapes[k], op.itemsize, arriving(
                     op, k, decisions[src.op].candidate.made), c.inputs[k])]
        comms += list(c.grad_sync)
        if searched[j].is_output:  # made whole for the caller or the next stage
            comms += edge_comms(op.out_shape, op.itemsize, c.made, (1,) * len(op.out_shape))
        again = rerun.get(j, 0.0)
        planned.append(PlannedOp(op.name, op.key, op.rule.name, c.strategy, decision.how, comms,
                                 c.compute, c.compute + sum(x.time(profile) for x in comms)
                                 + again, c.memory - dropped.get(j, 0.0), stage_of[j], again))
    return StrategyPlan(device_num, planned, profile, seconds, search_mode, notes,
                        {p: chosen[p] for p in layers if p in chosen}, costs,
                        {s: b for s, b in restore.items() if b})
