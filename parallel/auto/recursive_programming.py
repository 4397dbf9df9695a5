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
cheapest of the three plans is kept.

Single-operator moves cannot re-lay a chain: an operator DTensor runs (no module or ``shard``
key: a residual add, attention) takes its inputs as they arrive, so changing it, or one of its
neighbours, alone prices an infinite edge; and a column-parallel Linear only pays off with its
GELU. Each start therefore also tries chain moves (``relay_chains``): such a chain is re-laid as
one unit to a layout one of its neighbours holds (or whole), the operators up to ``REACH`` edges
around it respond, and the result is kept where the model prices it cheaper. Without them, on 4
ranks the recursive plan for the recipe GPT kept a batch-split residual stream that every
LayerNorm gathered (64 modelled collectives, 28% above the DP's plan). Operators alike whose
neighbours stand alike (a layer stack's) make each choice once. Annotated operators keep
their strategy; a parameter shared by two operators takes the layout the first of them chose.
The cost model is the one the other searches use, so the plans compare. The search itself is
greedy (no backtracking), which keeps it linear in the graph.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from parallel.auto.candidates import (
    NO_SHARDS,
    Candidate,
    OptimizerShards,
    _labels,
    _letter_sizes,
    annotated_candidate,
)
from parallel.auto.cost_model import DeviceProfile
from parallel.auto.graph import OpNode
from parallel.auto.memory_limit import within_memory
from parallel.auto.propagate import Decision, PricedGraph, _data_parallel
from parallel.auto.recompute_choice import LayerRecompute

#: passes per round: the first in weight order, then re-choices given the others' cuts
SWEEPS = 3
#: then passes in which each operator may take any of its candidates given its neighbours
#: (iterated conditional modes: a cut sequence cannot reach every strategy, this can)
REFINE = 2
#: how many edges from a re-laid chain its neighbours may respond (``relay_chains``)
REACH = 2
#: passes of chain moves, while one improves
RELAYS = 2


def _weight(op: OpNode) -> float:
    sizes = _letter_sizes(op, _labels(op))
    return math.prod(sizes.values())


def search(ops: list[OpNode], device_num: int, profile: DeviceProfile,
           max_device_memory: float | None = None, shards: OptimizerShards = NO_SHARDS,
           where: str = "", layouts: Mapping[str, tuple[int, ...]] | None = None,
           recompute: LayerRecompute | None = None) -> tuple[list[Decision], list[str]]:
    """A strategy for every operator (see the module docstring) holding at most
    ``max_device_memory`` bytes per device (``memory_limit.within_memory``: each byte is priced
    in every choice), and notes. Three starts are refined (always cutting, free to leave
    operators uncut, all data parallel: greedy cuts taken with few devices in view can mislead
    either way), chains are moved as units in each, and the cheapest plan is kept.
    ``recompute``: the graph's layers, each choosing its activation recompute under the limit
    too (``recompute_choice``)."""
    prices = PricedGraph(ops, device_num, profile, shards, layouts)
    fixed = {j for j, op in enumerate(ops) if op.annotated is not None}

    def run(price: float) -> tuple[list[Decision], list[str]]:
        plans, started = [], []
        for start in ("cut", "cut or stay", "data"):
            planner = _Bisection(prices, price)
            planner.start(start)
            if planner.current in started:  # two starts met: the chain moves would repeat
                continue
            started.append(list(planner.current))
            planner.relay_chains()
            plans.append(planner.current)
        best = min(plans, key=lambda chosen: prices.total(chosen, price))
        return [Decision(c, "annotated" if j in fixed else "searched")
                for j, c in enumerate(best)], []

    decisions, notes = within_memory(run, max_device_memory,
                                     where or f"on {device_num} devices", recompute)
    for j, decision in enumerate(decisions):  # conflicting annotations on a shared parameter
        prices.decided[j] = decision
    for j in range(len(ops)):
        prices.allowed(j, [decisions[j].candidate])
    return decisions, notes


class _Bisection:
    """One run of the planner: every operator's current candidate and cut, and what pricing a
    choice reads, precomputed per operator."""

    def __init__(self, prices: PricedGraph, memory_price: float) -> None:
        ops, shards = prices.ops, prices.shards
        self.prices, self.memory_price = prices, memory_price
        self.labels = [_labels(op) for op in ops]
        self.sizes = [_letter_sizes(op, lab) for op, lab in zip(ops, self.labels, strict=True)]
        # with optimizer parallel the batch is split over its data ranks before any cut
        self.slices = [{letter: shards.data if lab.inputs and lab.inputs[0]
                        and letter == lab.inputs[0][0] else 1 for letter in sizes}
                       for lab, sizes in zip(self.labels, self.sizes, strict=True)]
        self.refused: set[int] = set()  # ids of candidates permits() refuses (a start, a stay)
        self.current = [self.made(j, self.slices[j])[0] for j in range(len(ops))]
        self.fixed = {j for j, op in enumerate(ops) if op.annotated is not None}
        for j in self.fixed:
            self.current[j] = annotated_candidate(ops[j], prices.profile, shards)
        self.order = sorted((j for j in range(len(ops)) if j not in self.fixed),
                            key=lambda j: -_weight(ops[j]))
        partners = {(j, k): [(i, ki) for i, ki in pairs if i != j]
                    for pairs in prices.tied.values() for j, k in pairs}
        # what a price reads: (input, producer, shape) of each input an operator makes,
        # (consumer, its input, shape, itemsize) of each use of the output, shared parameters
        self.inputs = [[(k, src.op, op.shapes[k]) for k, src in enumerate(op.sources)
                        if src.linked] for op in ops]
        self.outputs = [[(m, k, ops[m].shapes[k], ops[m].itemsize) for m, k in consumers]
                        for consumers in prices.consumers]
        self.ties = [[(k, i, ki) for k in range(len(op.sources))
                      for i, ki in partners.get((j, k), [])] for j, op in enumerate(ops)]
        # operators alike (a layer stack's) whose neighbours stand alike choose alike: each
        # choice is made once per (operator kind, neighbours' layouts) and reused
        self.static = [(prices.kind[j], tuple(src.kind for src in ops[j].sources),
                        tuple((shape, n, ops[m].sources[k].kind)
                              for m, k, shape, n in self.outputs[j]))
                       for j in range(len(ops))]
        self.memo: dict[tuple, tuple[dict[str, int], Candidate]] = {}
        self.done: dict[int, bool] = {}
        self.by_inputs: dict[tuple, dict[tuple, list[Candidate]]] = {}  # for ``relay``
        self.option_sets: dict[tuple, set[int]] = {}  # for ``use_devices_fully``

    def start(self, how: str) -> None:
        """The plan from one start, refined: "cut" (bisection rounds, always cutting), "cut or
        stay" (an operator may stay uncut) or "data" (no rounds: every operator data
        parallel)."""
        if how == "data":
            self.start_data_parallel()
        else:
            self.cut_rounds(may_stay=how == "cut or stay")
            self.use_devices_fully()
        self.refine()

    def use_devices_fully(self) -> None:
        """Refuse what the cut rounds left using some devices but not all (an operator that
        stayed uncut in some rounds but not others: a GELU split 2 ways on 4 devices), so
        refinement replaces it with one of the candidates the other searches hold (every
        device, or one). Such plans were modelled a few percent below the DP's but measured
        1.57x the hand-written step on 4 ranks: DTensor runs their 2 x 2 meshes far slower than
        the model prices them."""
        for j, c in enumerate(self.current):
            kind = self.prices.kind[j]
            if kind not in self.option_sets:
                self.option_sets[kind] = {id(o) for o in self.prices.options[j]}
            if j not in self.fixed and id(c) not in self.option_sets[kind] and \
                    c not in self.prices.options[j]:
                self.refused.add(id(c))

    def made(self, j: int, cut: dict[str, int]) -> tuple[Candidate, bool]:
        c, permitted = self.prices.candidate(j, cut)
        if not permitted:
            self.refused.add(id(c))
        return c, permitted

    def price(self, j: int, c: Candidate) -> float:
        """``c``'s compute, own communication and memory price, and its edges with the
        neighbours as they stand; infinite where it may not stand."""
        if id(c) in self.refused:  # a start or a stay no strategy may keep
            return math.inf
        current, edge = self.current, self.prices.edge
        total = c.compute + self.prices.own(j, c) + self.memory_price * c.memory
        for k, i, _ in self.inputs[j]:
            total += edge(j, k, current[i].made, c.inputs[k])
        for m, k, _, _ in self.outputs[j]:
            total += edge(m, k, c.made, current[m].inputs[k])
        for k, i, ki in self.ties[j]:
            if current[i].inputs[ki] != c.inputs[k] and (i in self.fixed or self.done.get(i)):
                return math.inf  # a shared parameter has one layout
        return total

    def context(self, j: int) -> tuple:
        """Everything operator ``j``'s choice depends on besides its own cut."""
        current = self.current
        return (self.static[j],
                tuple(current[i].made for _, i, _ in self.inputs[j]),
                tuple(current[m].inputs[k] for m, k, _, _ in self.outputs[j]),
                tuple(current[i].inputs[ki] if i in self.fixed or self.done.get(i) else None
                      for _, i, ki in self.ties[j]))

    def cut(self, j: int, before: dict[str, int], may_stay: bool
            ) -> tuple[dict[str, int], Candidate]:
        """The cheapest two-way cut of ``before`` (or staying uncut, with ``may_stay``)."""
        options = [(before, self.made(j, before)[0])]
        for letter, size in self.sizes[j].items():
            if letter in self.labels[j].unsplit or size % (before[letter] * 2):
                continue
            trial = {**before, letter: before[letter] * 2}
            candidate, permitted = self.made(j, trial)
            if permitted:
                options.append((trial, candidate))
        if len(options) > 1 and not may_stay:  # a cut exists: take one
            options = options[1:]
        return min(options, key=lambda o: (self.price(j, o[1]), o[1].memory))

    def cut_rounds(self, may_stay: bool) -> None:
        """``log2`` of the searched devices rounds, heaviest operators first, each followed
        by up to ``SWEEPS - 1`` passes re-choosing given the others' cuts."""
        prices = self.prices
        for _ in range(int(math.log2(prices.device_num // prices.shards.data))):
            before = [dict(s) for s in self.slices]
            self.done = {}
            for _sweep in range(SWEEPS):
                changed = False
                for j in self.order:
                    key = ("cut", self.context(j), tuple(before[j].items()))
                    if key not in self.memo:
                        self.memo[key] = self.cut(j, before[j], may_stay)
                    chosen, best = self.memo[key]
                    changed |= chosen != self.slices[j]
                    self.slices[j], self.current[j] = chosen, best
                    self.done[j] = True
                if not changed:
                    break

    def start_data_parallel(self) -> None:
        for j in self.order:
            self.current[j] = _data_parallel(self.prices.options[j], self.prices.device_num)

    def refine(self, among: list[int] | None = None) -> None:
        """Up to ``REFINE`` passes in which each operator (of ``among``, default all) takes its
        cheapest whole strategy given its neighbours (iterated conditional modes)."""
        self.done = dict.fromkeys(range(len(self.current)), True)
        if among is None:
            order = self.order
        else:
            keep = set(among)
            order = [j for j in self.order if j in keep]
        for _sweep in range(REFINE):
            changed = False
            for j in order:
                key = ("any", self.context(j))
                if key not in self.memo:
                    self.memo[key] = ({}, min(self.prices.options[j], key=lambda c, j=j: (
                        self.price(j, c), c.compute, c.memory)))
                best = self.memo[key][1]
                if best is not self.current[j] and \
                        self.price(j, best) < self.price(j, self.current[j]):
                    self.current[j], changed = best, True
            if not changed:
                break

    def chains(self) -> list[list[int]]:
        """Operators that can only change layout together, each set in graph order: operators
        DTensor runs (no module or ``shard`` key) linked to one another (a residual stream's
        adds: each takes its inputs as they arrive), and a keyed elementwise operator with
        one input (a GELU: every candidate keeps its input's layout) joined to its keyed
        producer (a column-parallel Linear and its GELU only pay off together). Annotated
        operators join none."""
        ops, prices = self.prices.ops, self.prices
        root = list(range(len(ops)))

        def find(j: int) -> int:
            while root[j] != j:
                root[j] = root[root[j]]
                j = root[j]
            return j

        def follower(j: int) -> bool:
            return len(self.inputs[j]) == 1 and all(
                c.inputs and c.output == c.inputs[0] for c in prices.options[j])
        for j, op in enumerate(ops):
            for _k, i, _shape in self.inputs[j]:
                if {i, j} & self.fixed:
                    continue
                if (op.key is None) == (ops[i].key is None) and (op.key is None
                                                                 or follower(j)):
                    root[find(j)] = find(i)
        found: dict[int, list[int]] = {}
        for j in range(len(ops)):
            if j not in self.fixed:
                found.setdefault(find(j), []).append(j)
        return [chain for chain in found.values()
                if len(chain) > 1 or ops[chain[0]].key is None]

    def heads(self, chain: list[int]) -> list[Candidate]:
        """Layouts worth trying for ``chain``: its first operator's candidates that take or
        make a layout one of the chain's outside neighbours now makes or needs, or that leave a
        tensor whole (a chain moved elsewhere only pays at both ends)."""
        current, inside, ops = self.current, set(chain), self.prices.ops
        wanted = {(1,) * len(shape) for j in chain for shape in ops[j].shapes}
        for j in chain:
            wanted |= {self.prices.arriving(j, k, current[i].made).output
                       for k, i, _ in self.inputs[j] if i not in inside}
            wanted |= {current[m].inputs[k] for m, k, _, _ in self.outputs[j]
                       if m not in inside}
        return [c for c in self.prices.options[chain[0]]
                if c.output in wanted or any(split in wanted for split in c.inputs)]

    def relay(self, chain: list[int], head: Candidate) -> bool:
        """Lay ``chain`` out from its first operator's candidate ``head``: each later member
        takes the cheapest candidate that accepts its chain inputs as they now arrive; False
        where none does."""
        current, inside = self.current, set(chain)
        current[chain[0]] = head
        for m in chain[1:]:
            ks = tuple(k for k, i, _ in self.inputs[m] if i in inside)
            key = (self.prices.kind[m], ks)
            if key not in self.by_inputs:  # the member's candidates by those inputs' splits
                found: dict[tuple, list[Candidate]] = {}
                for c in self.prices.options[m]:
                    found.setdefault(tuple(c.inputs[k] for k in ks), []).append(c)
                self.by_inputs[key] = found
            arrive = tuple(self.prices.arriving(m, k, current[i].made).output
                           for k, i, _ in self.inputs[m] if i in inside)
            fits = self.by_inputs[key].get(arrive)
            if not fits:
                return False
            current[m] = min(fits, key=lambda c, m=m: (self.price(m, c), c.compute, c.memory))
        return True

    def around(self, chain: list[int]) -> list[int]:
        """``chain`` and the operators up to ``REACH`` edges from it: what a re-laid chain's
        neighbours respond within."""
        region = set(chain)
        for _ in range(REACH):
            region |= {i for j in region for _, i, _ in self.inputs[j]}
            region |= {m for j in list(region) for m, _, _, _ in self.outputs[j]}
        return sorted(region)

    def local(self, region: list[int]) -> float:
        """The part of the objective (``PricedGraph.total``) that operators in ``region``
        change: their own terms and every edge touching one of them; infinite where a shared
        parameter would get two layouts."""
        current, edge, inside = self.current, self.prices.edge, set(region)
        total = 0.0
        for j in region:
            c = current[j]
            if any(current[i].inputs[ki] != c.inputs[k] for k, i, ki in self.ties[j]):
                return math.inf
            total += c.compute + self.prices.own(j, c) + self.memory_price * c.memory
            for k, i, _ in self.inputs[j]:
                total += edge(j, k, current[i].made, c.inputs[k])
            for m, k, _, _ in self.outputs[j]:
                if m not in inside:
                    total += edge(m, k, c.made, current[m].inputs[k])
        return total

    def relay_chains(self) -> None:
        """Moves single-operator refinement cannot make (an operator DTensor runs takes its
        inputs as they arrive, so changing one member of a chain alone, or one of its
        neighbours alone, prices an infinite edge): re-lay a whole chain (``chains``,
        ``heads``), let the operators around it respond (``refine`` within ``around``), and
        keep the cheapest result if it beats the plan as it stood. Repeated while it
        improves, at most ``RELAYS`` times; each trial is priced on its region only, so a
        layer stack's many short chains stay cheap."""
        fruitless: set[tuple] = set()  # chains alike in contexts alike that found nothing
        # a region alike (same contexts, same candidates) re-laid before: its result (a layer
        # stack's chains are solved once), taken only where it lowers this region's price
        solved: dict[tuple, list[Candidate]] = {}
        for _round in range(RELAYS):
            improved = False
            for chain in self.chains():
                alike = tuple(self.context(j) for j in chain)
                if alike in fruitless:
                    continue
                region = self.around(chain)
                kept = [self.current[j] for j in region]
                best, best_cost = kept, self.local(region)
                seen = (tuple(region.index(j) for j in chain),
                        tuple(self.context(j) for j in region), tuple(map(id, kept)))
                if seen in solved:
                    for j, c in zip(region, solved[seen], strict=True):
                        self.current[j] = c
                    if self.local(region) < best_cost * (1 - 1e-9):
                        improved = True
                        continue
                    for j, c in zip(region, kept, strict=True):
                        self.current[j] = c
                for head in self.heads(chain):
                    if self.relay(chain, head):
                        self.refine(region)
                        cost = self.local(region)
                        if cost < best_cost * (1 - 1e-9):
                            best, best_cost = [self.current[j] for j in region], cost
                    for j, c in zip(region, kept, strict=True):
                        self.current[j] = c
                for j, c in zip(region, best, strict=True):
                    self.current[j] = c
                improved |= best is not kept
                if best is kept:
                    fruitless.add(alike)
                else:
                    solved[seen] = best
            if not improved:
                break
