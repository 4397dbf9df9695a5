"""Sharding propagation (MindSpore's strategy broadcast): annotated operators fix their strategies;
every other operator takes, in breadth-first order from them, the candidate whose redistribution
with its already-decided neighbours costs least. Only among candidates that redistribute equally
do the rest count (total-cost trade-offs belong to the searches): a candidate's own communication
(the backward all-reduce of a parameter's partial gradients when it splits work the parameter is
not split along, its own partial sums where it leaves the graph) plus, for each undecided
neighbour, the cheaper of following the candidate's layout exactly and meeting it whole, with that
neighbour's own communication (one step of lookahead), so an operator does not split what its next
consumer must gather again; then less compute, then less memory.
Operators no annotation reaches are data parallel (their first input split on its first
dimension over every device, where it divides). A parameter several operators consume (tied
embedding and head) gets one layout: later operators only take candidates that agree with it.


Candidates and their layouts are built in :mod:`parallel.auto.candidates`.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping

from parallel.auto.candidates import (
    NO_SHARDS,
    Candidate,
    Made,
    OptimizerShards,
    _candidate,
    _labels,
    _letter_sizes,
    annotated_candidate,
    arriving,
    candidates,
    edge_comms,
)
from parallel.auto.cost_model import DeviceProfile
from parallel.auto.graph import OpNode


@dataclasses.dataclass
class Decision:
    """How an operator got its strategy: "annotated", "propagated" or "data parallel"."""

    candidate: Candidate
    how: str


def _tied(ops: list[OpNode]) -> dict[str, list[tuple[int, int]]]:
    """Parameter name -> the (operator, input) pairs that consume it, for shared parameters."""
    users: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
    for j, op in enumerate(ops):
        for k, src in enumerate(op.sources):
            if src.kind == "param":
                users[src.param].append((j, k))
    return {name: pairs for name, pairs in users.items() if len(pairs) > 1}


def _reachable(preferred: set, best: dict) -> set:
    """The layouts lookahead prices a neighbour at: following or whole where the neighbour has
    them; else (an annotation that allows neither) every layout it has."""
    return (preferred & best.keys()) or set(best)


class PricedGraph:
    """The graph's edges, every operator's candidates, and cached edge prices: what every
    search prices with (and, by :meth:`run`, sharding propagation itself)."""

    def __init__(self, ops: list[OpNode], device_num: int, profile: DeviceProfile,
                 shards: OptimizerShards = NO_SHARDS,
                 layouts: Mapping[str, tuple[int, ...]] | None = None) -> None:
        self.ops, self.device_num, self.profile = ops, device_num, profile
        self.shards = shards
        # parameter name -> split vector decided elsewhere (a tie with an earlier stage)
        self.layouts = dict(layouts or {})
        # the blocks of a layer stack repeat: operators alike share one candidate list
        self.consumers: list[list[tuple[int, int]]] = [[] for _ in ops]
        self.opaque = [0] * len(ops)
        for j, op in enumerate(ops):
            for k, src in enumerate(op.sources):
                if src.linked:
                    self.consumers[src.op].append((j, k))
                if src.kind == "opaque" and src.op is not None:
                    self.opaque[src.op] += 1
        self.kind = [(_signature(op), self.opaque[j] > 0, self._fixed(op))
                     for j, op in enumerate(ops)]
        shared: dict[tuple, list[Candidate]] = {}
        for j, (op, kind) in enumerate(zip(ops, self.kind, strict=True)):
            if kind not in shared:
                shared[kind] = [c for c in candidates(op, device_num, profile,
                                                      shards=shards) if self.permits(j, c)]
        self.options = [shared[kind] for kind in self.kind]
        for j, options in enumerate(self.options):
            if not options:
                raise ValueError(
                    f"auto parallel: operator '{ops[j].name}' ({ops[j].key or 'functional'}, "
                    f"input shapes {list(ops[j].shapes)}) has no strategy that splits its batch "
                    f"over the {shards.data} data-parallel ranks and its parameters "
                    f"over at most {device_num // shards.data} devices, laying out the "
                    f"parameters an earlier stage shares as {dict(self._fixed(ops[j]))}")
        self.tied = _tied(ops)
        self.decided: dict[int, Decision] = {}
        self._edges: dict[tuple, float] = {}
        self._cuts: dict[tuple, tuple[Candidate, bool]] = {}
        # the cheapest own cost (gradient all-reduces) of an operator
        # whose input k has a given split / whose output has a given layout: for lookahead
        self._by_input: dict[tuple, dict[tuple, float]] = {}
        self._by_output: dict[tuple, dict[tuple, float]] = {}

    def candidate(self, j: int, slices: dict[str, int]) -> tuple[Candidate, bool]:
        """Operator ``j``'s candidate of ``slices`` (letter -> slice count) and whether
        :meth:`permits` allows it; cached per operator kind (the recursive planner asks for the
        same cuts of every layer of a stack)."""
        key = (self.kind[j], tuple(sorted(slices.items())))
        if key not in self._cuts:
            op = self.ops[j]
            labels = _labels(op)
            made = _candidate(op, labels, _letter_sizes(op, labels), slices, self.profile,
                              self.shards)
            self._cuts[key] = (made, self.permits(j, made))
        return self._cuts[key]

    def permits(self, j: int, c: Candidate) -> bool:
        """An output that a view reshapes (which the graph does not follow) may be split along
        its first, batch, dimension only, and hold no partial sums: the view keeps that
        dimension, whereas DTensor refuses to reshape one that does not split evenly (q|k|v
        packed in one Linear's output)."""
        if self.opaque[j] and (c.partial > 1 or any(n > 1 for n in c.output[1:])):
            return False
        if any(c.inputs[k] != split for k, split in self._fixed(self.ops[j])):
            return False
        return self.keeps_data_axis(j, c)

    def _fixed(self, op: OpNode) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """(input, split) of ``op``'s parameters whose layout was decided elsewhere."""
        return tuple((k, self.layouts[src.param]) for k, src in enumerate(op.sources)
                     if src.kind == "param" and src.param in self.layouts)

    def keeps_data_axis(self, j: int, c: Candidate) -> bool:
        """With optimizer parallel over ``data`` ranks: the batch split by a multiple of
        ``data`` and no parameter split over more than ``device_num / data`` devices."""
        data = self.shards.data
        if data == 1:
            return True
        params = [math.prod(split) for split, src in zip(c.inputs, self.ops[j].sources,
                                                         strict=False) if src.kind == "param"]
        return (bool(c.inputs) and bool(c.inputs[0]) and c.inputs[0][0] % data == 0
                and all(n <= self.device_num // data for n in params))

    # ----------------------------------------------------------------------------- prices
    def own(self, j: int, c: Candidate) -> float:
        """Communication ``c`` costs by itself: the all-reduces of parameter gradients its split
        work leaves partial, and, for a result that leaves the graph (the model's output, a
        pipeline stage's), making it whole."""
        op = self.ops[j]
        if not op.is_output:
            return c.sync_seconds
        return c.sync_seconds + self.edge_to(op.out_shape, op.itemsize, c.made,
                                             (1,) * len(op.out_shape))

    def total(self, chosen: list[Candidate], memory_price: float = 0.0) -> float:
        """The whole graph's modelled time for one candidate per operator (the searches'
        objective), plus ``memory_price`` seconds per byte of memory."""
        total = sum(c.compute + self.own(j, c) + memory_price * c.memory
                    for j, c in enumerate(chosen))
        for j, op in enumerate(self.ops):
            for k, src in enumerate(op.sources):
                if src.linked:
                    total += self.edge(j, k, chosen[src.op].made, chosen[j].inputs[k])
        return total

    def edge(self, consumer: int, k: int, made: Made, needed: tuple[int, ...]) -> float:
        """Seconds to bring a producer's output ``made`` to consumer input ``k``'s split;
        infinite where an operator DTensor runs (no module or ``shard`` key: the plan cannot
        set its layouts) would take the input in another split than it arrives: DTensor runs
        such an operator on what it receives and, where its inputs disagree, picks layouts of
        its own (a residual add of a replicated and a batch-split input comes out batch-split,
        not gathered), so a plan only counts on it where its inputs arrive as planned (partial
        sums are reduced, as DTensor does)."""
        op = self.ops[consumer]
        made = arriving(op, k, made)
        if op.key is None and made.output != needed:
            return math.inf
        return self.edge_to(op.shapes[k], op.itemsize, made, needed)

    def arriving(self, consumer: int, k: int, made: Made) -> Made:
        return arriving(self.ops[consumer], k, made)

    def edge_to(self, shape: tuple[int, ...], itemsize: int, made: Made,
                needed: tuple[int, ...]) -> float:
        key = (shape, itemsize, made, needed)
        if key not in self._edges:
            comms = edge_comms(shape, itemsize, made, needed)
            self._edges[key] = sum(x.time(self.profile) for x in comms)
        return self._edges[key]

    def _best_by_input(self, m: int, k: int) -> dict[tuple, float]:
        key = (self.kind[m], self.opaque[m], k)
        if key not in self._by_input:
            best: dict[tuple, float] = {}
            for n in self.options[m]:
                best[n.inputs[k]] = min(best.get(n.inputs[k], math.inf), self.own(m, n))
            self._by_input[key] = best
        return self._by_input[key]

    def _best_by_output(self, p: int) -> dict[tuple, float]:
        key = (self.kind[p], self.opaque[p])
        if key not in self._by_output:
            best: dict[tuple, float] = {}
            for n in self.options[p]:
                layout = (n.output, n.partial)
                best[layout] = min(best.get(layout, math.inf), self.own(p, n))
            self._by_output[key] = best
        return self._by_output[key]

    def lookahead(self, j: int, c: Candidate) -> float:
        """For each undecided neighbour, the cheaper of following ``c``'s layout exactly and
        meeting it whole (replicated), each with the neighbour's own communication then."""
        total = 0.0
        for m, k in self.consumers[j]:
            if m in self.decided:
                continue
            best = self._best_by_input(m, k)
            whole = (1,) * len(self.ops[m].shapes[k])
            follow = self.arriving(m, k, c.made).output
            total += min(self.edge(m, k, c.made, s) + best[s]
                         for s in _reachable({follow, whole}, best))
        for k, src in enumerate(self.ops[j].sources):
            if src.linked and src.op not in self.decided:
                best = self._best_by_output(src.op)
                whole = ((1,) * len(self.ops[src.op].out_shape), 1)
                follows = c.needs(k)
                total += min(self.edge(j, k, follows if layout == (c.inputs[k], 1) else
                                       Made(*layout), c.inputs[k]) + best[layout]
                             for layout in _reachable({(c.inputs[k], 1), whole}, best))
        return total

    def cost(self, j: int, c: Candidate) -> float:
        """Redistribution with the decided neighbours, own communication, and lookahead."""
        return self.redistribution(j, c) + self.own(j, c) + self.lookahead(j, c)

    def redistribution(self, j: int, c: Candidate) -> float:
        """What ``c`` costs to meet its decided neighbours' layouts: the collectives on the
        edges between them (not ``c``'s own partial sums or gradient reductions)."""
        total = 0.0
        for k, src in enumerate(self.ops[j].sources):
            if src.linked and src.op in self.decided:
                total += self.edge(j, k, self.decided[src.op].candidate.made, c.inputs[k])
        for m, k in self.consumers[j]:
            if m in self.decided:
                total += self.edge(m, k, c.made, self.decided[m].candidate.inputs[k])
        return total

    # ----------------------------------------------------------------------------- choices
    def allowed(self, j: int, options: list[Candidate]) -> list[Candidate]:
        """``options`` that lay a shared parameter out as its decided consumers do (a
        parameter has one layout); ValueError naming both operators when none can."""
        ops, allowed = self.ops, options
        for k, src in enumerate(ops[j].sources):
            for i, k_i in self.tied.get(src.param, []) if src.kind == "param" else []:
                if i == j or i not in self.decided:
                    continue
                need = self.decided[i].candidate.inputs[k_i]
                allowed = [c for c in allowed if c.inputs[k] == need]
                if not allowed:
                    raise ValueError(
                        f"auto parallel: parameter '{src.param}' is shared by operators "
                        f"'{ops[i].name}' ({ops[i].key or 'functional'}) and '{ops[j].name}' "
                        f"({ops[j].key or 'functional'}); the first lays it out as {need}, "
                        f"which no strategy of the second reconciles; annotate them alike")
        return allowed

    def neighbours(self, i: int) -> list[int]:
        """Where propagation goes next from ``i``: along direct edges only (the reference
        broadcasts strategies along its graph's edges; a view it does not follow stops it,
        though the edge behind the view is priced)."""
        producers = [s.op for s in self.ops[i].sources if s.op is not None]
        return producers + [j for j, k in self.consumers[i]
                            if self.ops[j].sources[k].kind == "op"]

    def run(self) -> list[Decision]:
        for i, op in enumerate(self.ops):
            if op.annotated is not None:
                chosen = annotated_candidate(op, self.profile, self.shards)
                self.allowed(i, [chosen])  # annotations must agree on shared parameters
                self.decided[i] = Decision(chosen, "annotated")
        queue = collections.deque(sorted(self.decided))
        while queue:
            i = queue.popleft()
            for j in self.neighbours(i):
                if j in self.decided:
                    continue
                # the reference's objective first: least redistribution against the decided
                # neighbours; among equals, own communication with lookahead, compute, memory
                best = min(self.allowed(j, self.options[j]), key=lambda c, j=j: (
                    self.redistribution(j, c), self.own(j, c) + self.lookahead(j, c),
                    c.compute, c.memory))
                self.decided[j] = Decision(best, "propagated")
                queue.append(j)
        for i in range(len(self.ops)):
            if i not in self.decided:
                allowed = self.allowed(i, self.options[i])
                self.decided[i] = Decision(_data_parallel(allowed, self.device_num),
                                           "data parallel")
        return [self.decided[i] for i in range(len(self.ops))]


def _signature(op: OpNode) -> tuple:
    """What an operator's candidates depend on: rule, ATen operator, shapes, settings, which
    inputs are parameters."""
    return (op.rule.name, op.target, op.shapes, op.out_shape, op.itemsize,
            tuple(sorted(op.info.items())), tuple(src.kind == "param" for src in op.sources),
            op.is_output)


def _data_parallel(options: list[Candidate], device_num: int) -> Candidate:
    def batch_only(c: Candidate) -> bool:
        first = c.inputs[0]
        return first[0] == device_num and all(s == 1 for s in first[1:]) and c.partial == 1
    return next((c for c in options if batch_only(c)), options[0])  # options[0]: all ones


def propagate(ops: list[OpNode], device_num: int, profile: DeviceProfile,
              shards: OptimizerShards = NO_SHARDS,
              layouts: Mapping[str, tuple[int, ...]] | None = None) -> list[Decision]:
    """Every operator's decision (see the module docstring)."""
    return PricedGraph(ops, device_num, profile, shards, layouts).run()
