"""Activation recompute in the auto-parallel memory model, chosen per layer by the searches.

**What a layer holds.** The memory model counts, for every operator, the slice of its output a
device keeps for backward (``Candidate.memory``: parameter copies plus that slice). A *layer* is
a layer of the model's layer stack, found as the pipeline splitter finds its units
(``parallel.pipeline.partition.unit_paths``: ``blocks.3`` of the recipe GPT, ``model.layers.3``
of a HuggingFace model); its operators are those whose module lies in it. What
``parallel.recompute(layer, mode)`` changes (see ``parallel/recompute.py``):

* ``none``: every operator's output slice stays, as modelled so far;
* ``selective``: the outputs of the matrix products (linear, matmul, mm, bmm: what
  ``parallel.recompute.SAVED_OPS`` keeps) stay; every other operator's (norms, attention's core,
  activations, residual adds) is dropped and recomputed in backward;
* ``full``: every output inside the layer is dropped; what leaves the layer stays (the output the
  next layer or the head reads is that reader's saved input, as the checkpoint keeps its inputs).
* ``offload``: every output inside the layer leaves the device as ``full``'s does, but nothing is
  run again: the bytes go to host memory in forward and come back in backward, one layer ahead
  (``hetero.offload.activations``). It costs the link time (``2 × bytes / host_bandwidth``) that
  the layer's own compute does not hide; offered only where the profile knows its host link.

An output that leaves the layer (read by an operator outside it, or by the caller) is never
dropped. In backward a recomputed layer brings what it dropped back for the time of its own
backward, so the peak holds, on top of what stays, the largest amount any one recomputed layer
drops (the *restore*; ``cluster_planner`` counts full recompute's working set the same way).

**What it costs.** An offloaded layer costs its exposed transfer (above). A recomputed operator
runs its forward again: a third of its modelled training compute (``candidates.TRAINING_PASSES``:
forward + backward at twice the forward), plus the forward collectives that bring its inputs into
its layout (DTensor redistributes inside the operator, so recomputing it redistributes again).
Backward collectives are not repeated.

**How it is chosen.** The searches meet ``max_device_memory`` by pricing every byte
(``memory_limit.within_memory``: Lagrangian relaxation, bisection on the price ``p``). At price
``p``, with the layouts the search chose at that price, each layer takes the mode that minimises
``added seconds - p x bytes dropped`` (a layer recomputes when its time cost is below ``p``
times the bytes it saves), the restore priced as well: for each cap on the restore every layer
takes its best mode within the cap, and the cheapest cap wins. Alike layers (a stack) then flip
together at one price, which can recompute every layer where a few suffice (the relaxation's
duality gap); so once the bisection has found the smallest price that fits, two repairs run and
the faster plan is kept: the plan that fits gives back recompute layer by layer while it still
fits (each time the move saving the most seconds), and the layouts of the last price that did
not fit take recompute layer by layer (each time the fewest seconds per byte saved) until they
fit. So the plan is the fastest combination of layouts and recompute the relaxation reaches.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from torch import nn

from hetero.placement import PlacedModule
from parallel.auto.candidates import TRAINING_PASSES, arriving, edge_comms
from parallel.auto.cost_model import DeviceProfile
from parallel.auto.graph import OpNode
from parallel.auto.propagate import Decision
from parallel.recompute import MODES, recompute_mode
from parallel.semi_auto.rules import BMM, LINEAR, MATMUL, MM

#: rules whose outputs selective recompute keeps (``parallel.recompute.SAVED_OPS``' operators)
KEPT_BY_SELECTIVE = frozenset({id(LINEAR), id(MATMUL), id(MM), id(BMM)})
_STACKS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def stack_layers(model: nn.Module) -> list[str]:
    """The paths of ``model``'s layers that recompute may wrap: the units of the pipeline
    splitter that are layers of a stack (``blocks.0``, ...), in order; none when the model has no
    stack the splitter opens, or is ``hetero.place``'d (``parallel.recompute`` refuses it)."""
    from parallel.pipeline.partition import unit_paths

    if any(isinstance(m, PlacedModule) for m in model.modules()):
        return []
    try:
        units = unit_paths(model)
    except ValueError:  # no layer stack (or parameters beside it): no layers to recompute
        return []
    modules = dict(model.named_modules())
    return [path for path in units
            if isinstance(modules.get(path.rpartition(".")[0]), _STACKS)]


@dataclasses.dataclass(frozen=True)
class RecomputeCost:
    """One layer under one recompute mode: activation bytes per device it keeps for backward
    (``held``), bytes dropped against ``none`` (``saved``; brought back while its own backward
    runs), and the modelled seconds the recomputed forward adds to a step (``seconds``)."""

    mode: str
    held: float
    saved: float
    seconds: float


@dataclasses.dataclass(frozen=True)
class PricedPlan:
    """One point of ``memory_limit``'s bisection: the layouts a search chose at a price, its
    notes, and each layer's recompute mode (``LayerRecompute.paths`` order; empty without
    layers)."""

    decisions: list[Decision]
    notes: list[str]
    modes: tuple[str, ...]


class LayerRecompute:
    """The layers of one searched graph (a pipeline stage's, or the whole model's) and the
    recompute each may take (module docstring). ``fixed``: layers the user already recomputed
    (path -> mode), counted at that mode and not changed.

    After :func:`memory_limit.within_memory` ran, :attr:`modes` holds the chosen mode of every
    layer (path -> mode) for the decisions it returned."""

    def __init__(self, ops: Sequence[OpNode], layers: Sequence[str], profile: DeviceProfile,
                 fixed: Mapping[str, str] | None = None) -> None:
        self.ops, self.profile = list(ops), profile
        fixed = dict(fixed or {})
        for path, mode in fixed.items():
            if mode not in MODES:
                raise ValueError(f"auto parallel recompute: layer '{path}' has mode {mode!r}, "
                                 f"not one of {MODES}")
        self.paths: list[str] = []
        self.members: list[list[int]] = []
        for path in layers:
            mine = [j for j, op in enumerate(self.ops)
                    if op.module == path or op.module.startswith(path + ".")]
            if mine:
                self.paths.append(path)
                self.members.append(mine)
        modes = MODES if profile.host_bandwidth > 0 else tuple(m for m in MODES
                                                               if m != "offload")
        self.allowed = [(fixed[p],) if p in fixed else modes for p in self.paths]
        inside = {j: i for i, mine in enumerate(self.members) for j in mine}
        self.leaves = set()  # operators whose output leaves their layer: never dropped
        for j, op in enumerate(self.ops):
            if op.is_output:
                self.leaves.add(j)
            for src in op.sources:
                if src.linked and src.op in inside and inside.get(j) != inside[src.op]:
                    self.leaves.add(src.op)
        self.modes: dict[str, str] = {}

    def __bool__(self) -> bool:
        return bool(self.paths)

    # ------------------------------------------------------------------ the memory model
    def _recomputed(self, j: int, mode: str) -> bool:
        if mode == "full":
            return True
        return mode == "selective" and id(self.ops[j].rule) not in KEPT_BY_SELECTIVE

    def _dropped(self, j: int, mode: str) -> bool:
        """Whether operator ``j``'s output leaves the device under ``mode`` (not if it leaves
        the layer: the reader keeps it)."""
        return (mode == "offload" or self._recomputed(j, mode)) and j not in self.leaves

    def _link_seconds(self, saved: float, mine: Sequence[int],
                      decisions: Sequence[Decision]) -> float:
        """An offloaded layer's transfer down and back that its own compute does not hide."""
        if self.profile.host_bandwidth <= 0:
            return 0.0  # a layer the user offloaded on an unprofiled link: not priced
        hidden = sum(decisions[j].candidate.compute for j in mine)
        return max(0.0, 2 * saved / self.profile.host_bandwidth - hidden)

    def _activation(self, j: int, decision: Decision) -> float:
        op, c = self.ops[j], decision.candidate
        return math.prod(op.out_shape) / math.prod(c.output) * op.itemsize

    def _forward_seconds(self, j: int, decisions: Sequence[Decision]) -> float:
        """Operator ``j``'s forward run again: its compute and the forward collectives that
        lay its inputs out."""
        op, c = self.ops[j], decisions[j].candidate
        seconds = c.compute / TRAINING_PASSES
        for k, src in enumerate(op.sources):
            if src.linked:
                made = arriving(op, k, decisions[src.op].candidate.made)
                seconds += sum(comm.time(self.profile) for comm in edge_comms(
                    op.shapes[k], op.itemsize, made, c.inputs[k]) if not comm.backward)
        return seconds

    def costs(self, decisions: Sequence[Decision]) -> list[dict[str, RecomputeCost]]:
        """Per layer, mode -> :class:`RecomputeCost` under ``decisions``' layouts (every mode,
        the fixed layers' too)."""
        found = []
        for mine in self.members:
            acts = {j: self._activation(j, decisions[j]) for j in mine}
            total = sum(acts.values())
            per_mode = {}
            for mode in MODES:
                dropped = [j for j in mine if self._dropped(j, mode)]
                rerun = [j for j in mine if self._recomputed(j, mode)]
                saved = sum(acts[j] for j in dropped)
                seconds = sum(self._forward_seconds(j, decisions) for j in rerun)
                if mode == "offload":
                    seconds = self._link_seconds(saved, mine, decisions)
                per_mode[mode] = RecomputeCost(mode, total - saved, saved, seconds)
            found.append(per_mode)
        return found

    def per_op(self, decisions: Sequence[Decision], modes: Mapping[str, str]
               ) -> tuple[dict[int, float], dict[int, float]]:
        """Under the layer ``modes``: the bytes each operator drops, and the seconds each adds."""
        dropped, seconds = {}, {}
        for path, mine in zip(self.paths, self.members, strict=True):
            mode = modes.get(path, "none")
            for j in mine:
                if self._recomputed(j, mode):
                    seconds[j] = self._forward_seconds(j, decisions)
                if self._dropped(j, mode):
                    dropped[j] = self._activation(j, decisions[j])
            if mode == "offload" and mine:  # the layer's exposed transfer, on its first op
                seconds[mine[0]] = self._link_seconds(
                    sum(dropped.get(j, 0.0) for j in mine), mine, decisions)
        return dropped, seconds

    def restore(self, costs: list[dict[str, RecomputeCost]], modes: Sequence[str]) -> float:
        """The bytes the largest recomputed layer brings back in its backward."""
        return max((cost[mode].saved for cost, mode in zip(costs, modes, strict=True)),
                   default=0.0)

    def memory(self, decisions: Sequence[Decision], modes: Sequence[str],
               costs: list[dict[str, RecomputeCost]] | None = None,
               layouts: float | None = None) -> float:
        """Modelled peak bytes per device: the layouts' memory (``layouts``, when known) less
        what recompute drops, plus the restore."""
        costs = costs if costs is not None else self.costs(decisions)
        if layouts is None:
            layouts = sum(d.candidate.memory for d in decisions)
        saved = sum(cost[mode].saved for cost, mode in zip(costs, modes, strict=True))
        return layouts - saved + self.restore(costs, modes)

    def step_seconds(self, decisions: Sequence[Decision], modes: Sequence[str],
                     costs: list[dict[str, RecomputeCost]] | None = None) -> float:
        """Modelled step time: every operator's compute, the collectives on its inputs, its
        gradient all-reduces and its output made whole where it leaves the graph (as
        ``StrategyPlan.cost`` counts them), plus the recomputed forwards."""
        total = 0.0
        for op, decision in zip(self.ops, decisions, strict=True):
            c = decision.candidate
            comms = [comm for k, src in enumerate(op.sources) if src.linked
                     for comm in edge_comms(op.shapes[k], op.itemsize, arriving(
                         op, k, decisions[src.op].candidate.made), c.inputs[k])]
            comms += list(c.grad_sync)
            if op.is_output:
                comms += edge_comms(op.out_shape, op.itemsize, c.made, (1,) * len(op.out_shape))
            total += c.compute + sum(comm.time(self.profile) for comm in comms)
        costs = costs if costs is not None else self.costs(decisions)
        return total + sum(cost[mode].seconds for cost, mode in zip(costs, modes, strict=True))

    # ------------------------------------------------------------------ the choice
    def choose(self, decisions: list[Decision], price: float) -> tuple[str, ...]:
        """Each layer's mode at memory price ``price`` (seconds per byte), given the layouts:
        the least ``seconds - price x saved`` with the restore priced too (module docstring)."""
        unpriced = tuple(a[0] if len(a) == 1 else "none" for a in self.allowed)
        if price <= 0.0:  # recompute only costs time
            return unpriced
        costs = self.costs(decisions)
        caps = sorted({0.0, *(cost[m].saved for cost, allowed in zip(costs, self.allowed,
                                                                     strict=True)
                             for m in allowed)})
        best, best_value = unpriced, math.inf
        for cap in caps:
            modes, value = [], 0.0
            for cost, allowed in zip(costs, self.allowed, strict=True):
                fits = [m for m in allowed if cost[m].saved <= cap]
                if not fits:
                    break
                mode = min(fits, key=lambda m, cost=cost: (
                    cost[m].seconds - price * cost[m].saved, MODES.index(m)))
                modes.append(mode)
                value += cost[mode].seconds - price * cost[mode].saved
            else:
                value += price * self.restore(costs, modes)
                if value < best_value:
                    best, best_value = tuple(modes), value
        return best

    def found(self, search_result: tuple[list[Decision], list[str]], price: float
              ) -> PricedPlan:
        """A search's result at ``price`` with each layer's mode chosen at that price."""
        decisions, notes = search_result
        return PricedPlan(decisions, notes, self.choose(decisions, price))

    def held(self, found: PricedPlan) -> float:
        """``found``'s modelled peak bytes per device, recompute counted."""
        return self.memory(found.decisions, found.modes)

    def _moves(self, modes: tuple[str, ...], more: bool,
               costs: list[dict[str, RecomputeCost]]) -> list[tuple[int, str]]:
        """Single-layer changes to more (or less) recompute than ``modes``; of alike layers
        (same costs, same mode) only the first's: their moves change the plan alike."""
        moves, seen = [], set()
        for i, (mode, allowed) in enumerate(zip(modes, self.allowed, strict=True)):
            alike = (tuple(costs[i].values()), mode, allowed)
            if alike in seen:
                continue
            seen.add(alike)
            for other in allowed:
                if (MODES.index(other) > MODES.index(mode)) == more and other != mode:
                    moves.append((i, other))
        return moves

    def _trim(self, found: PricedPlan, limit: float) -> PricedPlan:
        """Give recompute back while the plan fits, the move saving most seconds first (a move
        that saves none, e.g. offload back to full recompute, is not one)."""
        costs = self.costs(found.decisions)
        layouts = sum(d.candidate.memory for d in found.decisions)
        modes = found.modes
        while True:
            options = []
            for i, other in self._moves(modes, False, costs):
                trial = (*modes[:i], other, *modes[i + 1:])
                gain = costs[i][modes[i]].seconds - costs[i][other].seconds
                if gain > 0 and self.memory(found.decisions, trial, costs, layouts) <= limit:
                    options.append((-gain, i, trial))
            if not options:
                return dataclasses.replace(found, modes=modes)
            modes = min(options)[2]

    def _fill(self, found: PricedPlan, limit: float) -> PricedPlan | None:
        """Take recompute until the plan fits, the fewest seconds per byte saved first; None
        when even all of it does not fit."""
        costs = self.costs(found.decisions)
        layouts = sum(d.candidate.memory for d in found.decisions)
        modes = found.modes
        held = self.memory(found.decisions, modes, costs, layouts)
        while held > limit:
            options = []
            for i, other in self._moves(modes, True, costs):
                trial = (*modes[:i], other, *modes[i + 1:])
                after = self.memory(found.decisions, trial, costs, layouts)
                if after < held:
                    added = costs[i][other].seconds - costs[i][modes[i]].seconds
                    options.append((added / (held - after), i, trial, after))
            if not options:
                return None
            _, _, modes, held = min(options)
        return self._trim(dataclasses.replace(found, modes=modes), limit)

    def settle(self, fitting: PricedPlan, short: PricedPlan | None, limit: float | None
               ) -> PricedPlan:
        """The faster of the two repairs (module docstring); records :attr:`modes`."""
        best = fitting
        if limit is not None and self:
            best = self._trim(fitting, limit)
            filled = self._fill(short, limit) if short is not None else None
            if filled is not None and self.step_seconds(filled.decisions, filled.modes) < \
                    self.step_seconds(best.decisions, best.modes):
                best = filled
        self.modes = dict(zip(self.paths, best.modes, strict=True))
        return best

    def note(self, found: PricedPlan) -> str:
        """What recompute the plan chose, for its notes."""
        chosen = {p: m for p, m in zip(self.paths, found.modes, strict=True) if m != "none"}
        if not chosen:
            return ""
        costs = self.costs(found.decisions)
        saved = sum(c[m].saved for c, m in zip(costs, found.modes, strict=True))
        seconds = sum(c[m].seconds for c, m in zip(costs, found.modes, strict=True))
        return (f"recompute on {len(chosen)} of {len(self.paths)} layers: drops "
                f"{saved / 2**20:.1f} MiB of activations (restores at most "
                f"{self.restore(costs, found.modes) / 2**20:.1f} MiB in backward), adds "
                f"{seconds * 1e3:.3f} ms")


def fixed_modes(model: nn.Module, layers: Sequence[str]) -> dict[str, str]:
    """The layers among ``layers`` the user already recomputed (``parallel.recompute``)."""
    modules = dict(model.named_modules())
    return {path: recompute_mode(modules[path]) for path in layers
            if recompute_mode(modules[path]) is not None}
