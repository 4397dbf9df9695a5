"""Which pipeline stage runs which layer: units, their order and cost, and the stage plan.

A *unit* is what a stage holds whole: each child of the model, except that a module holding the
layer stack (an ``nn.ModuleList`` / ``ModuleDict`` / ``Sequential`` somewhere below it) is opened
and the stack's layers become units (``blocks.0``, ``blocks.1``, ... ; ``model.layers.3`` in
HuggingFace's nesting). Units run in one order; a stage is a contiguous run of them.

The order and each unit's FLOPs come from one forward on fake tensors (``FakeTensorMode`` +
``FlopCounterMode``: nothing is computed or allocated, so this works for models larger than the
host); without example inputs the registration order is used and only parameters are costed.

Stages come from ``parallel.pipeline_stage`` tags / ``ParallelConfig.stages`` (an untagged unit
joins the stage of the tagged unit before it, or stage 0 at the start) or, with no tags, from an
automatic split that minimises the largest stage's cost (FLOPs share + parameter share: compute
time and memory weigh alike) by dynamic programming over the contiguous splits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from foundation.compat import fake_tensor_mode
from parallel.pipeline.dry_run import fake_inputs, tensor_attributes_kept

_STACKS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


@dataclasses.dataclass(frozen=True)
class Unit:
    path: str
    params: int  # parameter elements (tied ones counted where first used)
    flops: int  # forward FLOPs for the example micro-batch (0 without one)
    layer: bool  # a layer of a stack (automatic splits cut only between two layers)


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """Units in run order, each unit's stage, and where the split came from."""

    units: tuple[Unit, ...]
    stage_of: dict[str, int]
    num_stages: int
    source: str  # "tags" or "automatic"

    def stage_units(self, stage: int) -> list[str]:
        return [u.path for u in self.units if self.stage_of[u.path] == stage]

    def explain(self) -> str:
        """One line per stage: its units, parameters and FLOPs share."""
        total_p = sum(u.params for u in self.units) or 1
        total_f = sum(u.flops for u in self.units) or 1
        lines = [f"pipeline: {self.num_stages} stages ({self.source} split)"]
        for s in range(self.num_stages):
            mine = [u for u in self.units if self.stage_of[u.path] == s]
            p, f = sum(u.params for u in mine), sum(u.flops for u in mine)
            lines.append(f"  stage {s}: {_span([u.path for u in mine])}  params {p:,} "
                         f"({100 * p / total_p:.0f}%)  flops {f:,} ({100 * f / total_f:.0f}%)")
        return "\n".join(lines)


def _span(paths: list[str]) -> str:
    return paths[0] if len(paths) == 1 else f"{paths[0]} .. {paths[-1]} ({len(paths)} units)"


def _has_stack(module: nn.Module) -> bool:
    return any(isinstance(m, _STACKS) and len(m) for m in module.modules())


def unit_paths(model: nn.Module) -> list[str]:
    """The units of ``model`` in registration order (see the module docstring)."""
    def walk(module: nn.Module, prefix: str) -> list[str]:
        if module._parameters and any(p is not None for p in module._parameters.values()):
            raise ValueError(f"pipeline split: {prefix.rstrip('.') or type(module).__name__} "
                             f"holds parameters {sorted(module._parameters)} directly beside the "
                             f"layer stack; move them into a submodule so one stage owns them")
        found = []
        for name, child in module.named_children():
            path = prefix + name
            if isinstance(child, _STACKS) and len(child):
                found += [f"{path}.{key}" for key in child._modules]
            elif _has_stack(child):
                found += walk(child, path + ".")
            else:
                found.append(path)
        return found

    if not _has_stack(model):
        raise ValueError(f"pipeline split: {type(model).__name__} has no layer stack (an "
                         f"nn.ModuleList, ModuleDict or Sequential of layers) to divide")
    return walk(model, "")


def measure_units(model: nn.Module, paths: Sequence[str],
                  example_inputs: tuple | None) -> list[Unit]:
    """Units in run order with their parameters and forward FLOPs (see the module docstring)."""
    modules = dict(model.named_modules())
    stacks = {p for p, m in modules.items() if isinstance(m, _STACKS)}
    order: list[str] = []
    flops: dict[str, int] = dict.fromkeys(paths, 0)
    if example_inputs is not None:
        counter = FlopCounterMode(display=False)
        handles = []
        for path in paths:
            def pre(_m: nn.Module, _a: Any, path: str = path) -> None:
                if path not in order:
                    order.append(path)
                flops[path] -= counter.get_total_flops()

            def post(_m: nn.Module, _a: Any, _o: Any, path: str = path) -> None:
                flops[path] += counter.get_total_flops()
            handles += [modules[path].register_forward_pre_hook(pre),
                        modules[path].register_forward_hook(post)]
        try:
            with tensor_attributes_kept(model), fake_tensor_mode() as mode, counter, \
                    torch.no_grad():
                model(*fake_inputs(model, mode, example_inputs))
        finally:
            for handle in handles:
                handle.remove()
    order += [p for p in paths if p not in order]  # units the example did not run keep their place
    seen: set[int] = set()
    units = []
    for path in order:
        fresh = [p for p in modules[path].parameters() if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        units.append(Unit(path, sum(p.numel() for p in fresh), max(flops[path], 0),
                          path.rsplit(".", 1)[0] in stacks))
    return units


def plan_stages(model: nn.Module, num_stages: int, tags: dict[str, int],
                example_inputs: tuple | None = None) -> StagePlan:
    """The stage of every unit of ``model`` for ``num_stages`` stages; ValueError naming the
    unit and the rule for tags that are out of range, not contiguous, on part of a unit, or that
    leave a stage without parameters."""
    paths = unit_paths(model)
    units = measure_units(model, paths, example_inputs)
    if len(units) < num_stages:
        raise ValueError(f"pipeline split: {num_stages} stages but {type(model).__name__} has "
                         f"only {len(units)} units ({[u.path for u in units]})")
    if tags:
        stage_of = _from_tags(units, tags, num_stages)
        source = "tags"
    else:
        stage_of = _balanced(units, num_stages)
        source = "automatic"
    plan = StagePlan(tuple(units), stage_of, num_stages, source)
    for s in range(num_stages):
        if not any(u.params for u in units if stage_of[u.path] == s):
            raise ValueError(f"pipeline split: stage {s} ({plan.stage_units(s) or 'no units'}) "
                             f"has no parameters; every stage needs some to train")
    return plan


def _unit_tag(path: str, tags: dict[str, int]) -> int | None:
    """The tag on ``path`` or its nearest tagged ancestor."""
    parts = path.split(".")
    for k in range(len(parts), 0, -1):
        if ".".join(parts[:k]) in tags:
            return tags[".".join(parts[:k])]
    return None


def _from_tags(units: list[Unit], tags: dict[str, int], num_stages: int) -> dict[str, int]:
    names = {u.path for u in units}
    for path, stage in tags.items():
        if stage >= num_stages:
            raise ValueError(f"pipeline split: {path!r} is tagged stage {stage}, but there are "
                             f"{num_stages} stages (0..{num_stages - 1})")
        if path not in names and not any(n.startswith(path + ".") for n in names):
            raise ValueError(f"pipeline split: {path!r} is part of a unit; tag whole units "
                             f"(one of {sorted(names)}) or their containers")
    stage_of, current, last_tagged = {}, 0, "the start"
    for unit in units:
        tag = _unit_tag(unit.path, tags)
        if tag is not None:
            if tag < current:
                raise ValueError(f"pipeline split: {unit.path!r} is tagged stage {tag} but runs "
                                 f"after {last_tagged!r} of stage {current}; stage tags must not "
                                 f"go back (stages run in order, each a contiguous run of layers)")
            current, last_tagged = tag, unit.path
        stage_of[unit.path] = current
    used = sorted(set(stage_of.values()))
    missing = sorted(set(range(num_stages)) - set(used))
    if missing:
        raise ValueError(f"pipeline split: no unit is tagged for stage(s) {missing} of "
                         f"{num_stages}; tags skip stages")
    return stage_of


def _balanced(units: list[Unit], num_stages: int) -> dict[str, int]:
    """Contiguous split minimising the largest stage cost; each stage gets a parameter. Cuts
    fall only between two layers of a stack: what runs before the first layer (embeddings) stays
    with it and what runs after the last (final norm, head) with that one, since a model's
    forward treats those as one piece (a stage without the embedding skips the position one too).
    """
    total_p = sum(u.params for u in units) or 1
    total_f = sum(u.flops for u in units) or 1
    cost = [u.params / total_p + u.flops / total_f for u in units]
    n = len(units)
    prefix = [0.0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    has_param = [0]
    for u in units:
        has_param.append(has_param[-1] + (u.params > 0))
    inf = float("inf")
    # best[k][i]: the least max-cost of the first i units in k stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                if has_param[i] == has_param[j] or best[k - 1][j] == inf:
                    continue
                if 0 < j and not (units[j - 1].layer and units[j].layer):
                    continue
                if i < n and not (units[i - 1].layer and units[i].layer):
                    continue
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    if best[num_stages][n] == inf:
        layers = sum(u.layer for u in units)
        raise ValueError(f"pipeline split: the automatic split cuts only between layers, and "
                         f"{layers} layers ({[u.path for u in units if u.layer]}) cannot make "
                         f"{num_stages} stages; use fewer stages (or fewer per rank), more "
                         f"layers, or tag the stages (parallel.pipeline_stage)")
    stage_of, i = {}, n
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        for unit in units[j:i]:
            stage_of[unit.path] = k - 1
        i = j
    return stage_of
