"""Strategy search by recursive bisection (MindSpore's symbolic automatic parallel planner,
"recursive programming"): fast plans for graphs and device counts where the dynamic programming's
matrices grow too large.

The devices are cut in two ``log2(device_num)`` times. In each round every operator, heaviest
first (by FLOPs), chooses which of its dimension letters to cut in two: the cut whose cost is
least given its neighbours' layouts as they stand. The cost counts its compute, its own
communication (parameter-gradient all-reduces) and the redistribution with each neighbour
(partial sums a contracted cut leaves are reduced there). The bisection runs twice: always
cutting where a cut exists, and free to leave an operator uncut (its work repeats on both
halves) where communication costs more than the halved compute saves.
After the first pass each operator reconsiders its cut given the cuts the others took (up
to ``SWEEPS`` passes, until nothing changes).

A cut sequence cannot reach every strategy, so ``REFINE`` final passes let each operator take
any of its candidates given its neighbours (iterated conditional modes). Those passes only reach
a local optimum: cuts taken with few devices in view can mix layouts (half the devices on the
batch, half on the hidden size) that no single operator can leave alone. A third start is
therefore refined too, every operator data parallel (the batch cut ``log2 N`` times), and the
cheapest of the three plans is kept. Operators alike whose neighbours stand alike (a layer stack's)
make each choice once. Annotated operators keep
their strategy; a parameter shared by two operators takes the layout the first of them chose.
The cost model is the one the other searches use, so the plans compare. The search itself is
greedy (no backtracking), which keeps it linear in the graph.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from parallel.auto.cost_model import DeviceProfile
from parallel.auto.graph import OpNode
from parallel.auto.memory_limit import within_memory
from parallel.auto.propagate import (
    NO_SHARDS,
    Candidate,
    Decision,
    OptimizerShards,
    PricedGraph,
    _data_parallel,
    _labels,
    _letter_sizes,
    annotated_candidate,
)

#: passes per round: the first in weight order, then re-choices given the others' cuts
SWEEPS = 3
#: then passes in which each operator may take any of its candidates given its neighbours
#: (iterated conditional modes: a cut sequence cannot reach every strategy, this can)
REFINE = 2


def _weight(op: OpNode) -> float:
    sizes = _letter_sizes(op, _labels(op))
    return math.prod(sizes.values())


def _total(prices: PricedGraph, chosen: list[Candidate], price: float = 0.0) -> float:
    """The whole graph's modelled time for one candidate per operator (plus ``price`` seconds
    per byte of memory)."""
    total = sum(c.compute + prices.own(j, c) + price * c.memory for j, c in enumerate(chosen))
    for j, op in enumerate(prices.ops):
        for k, src in enumerate(op.sources):
            if src.kind == "op":
                made = chosen[src.op]
                total += prices.edge(j, k, made.output, made.partial, chosen[j].inputs[k])
    return total


def search(ops: list[OpNode], device_num: int, profile: DeviceProfile,
           max_device_memory: float | None = None, shards: OptimizerShards = NO_SHARDS,
           where: str = "", layouts: Mapping[str, tuple[int, ...]] | None = None
           ) -> tuple[list[Decision], list[str]]:
    """A strategy for every operator (see the module docstring) holding at most
    ``max_device_memory`` bytes per device (``memory_limit.within_memory``: each byte is priced
    in every choice), and notes. Three starts are refined (always cutting, free to leave
    operators uncut, all data parallel: greedy cuts taken with few devices in view can mislead
    either way) and the cheapest plan is kept."""
    prices = PricedGraph(ops, device_num, profile, shards, layouts)
    fixed = {j for j, op in enumerate(ops) if op.annotated is not None}

    def run(price: float) -> tuple[list[Decision], list[str]]:
        runs = [_bisect(prices, start, price) for start in ("cut", "cut or stay", "data")]
        best = min(runs, key=lambda chosen: _total(prices, chosen, price))
        return [Decision(c, "annotated" if j in fixed else "searched")
                for j, c in enumerate(best)], []

    decisions, notes = within_memory(run, max_device_memory,
                                     where or f"on {device_num} devices")
    for j, decision in enumerate(decisions):  # conflicting annotations on a shared parameter
        prices.decided[j] = decision
    for j in range(len(ops)):
        prices.allowed(j, [decisions[j].candidate])
    return decisions, notes


def _bisect(prices: PricedGraph, start: str, memory_price: float) -> list[Candidate]:
    """The plan from one start: "cut" (bisection rounds, always cutting), "cut or stay" (an
    operator may stay uncut) or "data" (no rounds: every operator data parallel), each then
    refined."""
    may_stay = start == "cut or stay"
    ops, device_num, profile, shards = prices.ops, prices.device_num, prices.profile, prices.shards
    labels = [_labels(op) for op in ops]
    sizes = [_letter_sizes(op, lab) for op, lab in zip(ops, labels, strict=True)]
    # with optimizer parallel the batch is split over its data ranks before any cut is chosen
    slices = [{letter: shards.data if lab.inputs and lab.inputs[0] and letter == lab.inputs[0][0]
               else 1 for letter in s} for lab, s in zip(labels, sizes, strict=True)]
    refused: set[int] = set()  # ids of candidates permits() refuses (a start, a stay)

    def made(j: int, cut: dict[str, int]) -> tuple[Candidate, bool]:
        c, permitted = prices.candidate(j, cut)
        if not permitted:
            refused.add(id(c))
        return c, permitted
    current: list[Candidate] = [made(j, slices[j])[0] for j in range(len(ops))]
    fixed = {j for j, op in enumerate(ops) if op.annotated is not None}
    for j in fixed:
        current[j] = annotated_candidate(ops[j], profile, shards)
    partners = {(j, k): [(i, ki) for i, ki in pairs if i != j]
                for pairs in prices.tied.values() for j, k in pairs}
    order = sorted((j for j in range(len(ops)) if j not in fixed),
                   key=lambda j: -_weight(ops[j]))

    # per operator, what its price reads: (input, producer, shape) of each input an operator
    # makes, (consumer, its input, shape) of each use of its output, and shared parameters
    inputs = [[(k, src.op, op.shapes[k]) for k, src in enumerate(op.sources) if src.kind == "op"]
              for op in ops]
    outputs = [[(m, k, ops[m].shapes[k], ops[m].itemsize) for m, k in prices.consumers[j]]
               for j in range(len(ops))]
    ties = [[(k, i, ki) for k in range(len(op.sources)) for i, ki in partners.get((j, k), [])]
            for j, op in enumerate(ops)]
    edge = prices.edge_to

    def price(j: int, c: Candidate) -> float:
        if id(c) in refused:  # a start or a stay no strategy may keep
            return math.inf
        size = ops[j].itemsize
        total = c.compute + c.sync_seconds + memory_price * c.memory
        for k, i, shape in inputs[j]:
            total += edge(shape, size, current[i].output, current[i].partial, c.inputs[k])
        for m, k, shape, itemsize in outputs[j]:
            total += edge(shape, itemsize, c.output, c.partial, current[m].inputs[k])
        for k, i, ki in ties[j]:
            if current[i].inputs[ki] != c.inputs[k] and (i in fixed or done.get(i)):
                return math.inf  # a shared parameter has one layout
        return total

    # operators alike (a layer stack's) whose neighbours stand alike choose alike: each choice
    # is made once per (operator kind, neighbours' layouts) and reused
    static = [(prices.kind[j], tuple((shape, n) for _, _, shape, n in outputs[j]))
              for j in range(len(ops))]
    memo: dict[tuple, tuple[dict[str, int], Candidate]] = {}

    def context(j: int) -> tuple:
        return (static[j],
                tuple((current[i].output, current[i].partial) for _, i, _ in inputs[j]),
                tuple(current[m].inputs[k] for m, k, _, _ in outputs[j]),
                tuple(current[i].inputs[ki] if i in fixed or done.get(i) else None
                      for _, i, ki in ties[j]))

    def cut(j: int) -> tuple[dict[str, int], Candidate]:
        """The cheapest cut of ``before[j]`` (or the stay, ``may_stay``)."""
        lab = labels[j]
        options = [(before[j], made(j, before[j])[0])]
        for letter, size in sizes[j].items():
            if letter in lab.unsplit or size % (before[j][letter] * 2):
                continue
            trial = {**before[j], letter: before[j][letter] * 2}
            candidate, permitted = made(j, trial)
            if permitted:
                options.append((trial, candidate))
        if len(options) > 1 and not may_stay:  # a cut exists: take one
            options = options[1:]
        return min(options, key=lambda o: (price(j, o[1]), o[1].memory))

    done: dict[int, bool] = {}
    if start == "data":
        for j in order:
            current[j] = _data_parallel(prices.options[j], device_num)
    rounds = 0 if start == "data" else int(math.log2(device_num // shards.data))
    for _ in range(rounds):
        before = [dict(s) for s in slices]
        done = {}
        for _sweep in range(SWEEPS):  # then each operator reconsiders its cut given the others'
            changed = False
            for j in order:
                key = ("cut", context(j), tuple(before[j].items()))
                if key not in memo:
                    memo[key] = cut(j)
                chosen, best = memo[key]
                changed |= chosen != slices[j]
                slices[j], current[j] = chosen, best
                done[j] = True
            if not changed:
                break
    done = dict.fromkeys(range(len(ops)), True)
    for _sweep in range(REFINE):  # each operator's whole strategy, given its neighbours' now
        changed = False
        for j in order:
            key = ("any", context(j))
            if key not in memo:
                memo[key] = ({}, min(prices.options[j],
                                     key=lambda c, j=j: (price(j, c), c.compute, c.memory)))
            best = memo[key][1]
            if price(j, best) < price(j, current[j]):
                current[j], changed = best, True
        if not changed:
            break
    return current
