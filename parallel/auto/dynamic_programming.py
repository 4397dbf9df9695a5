"""Strategy search by dynamic programming over the operator graph (MindSpore's L2 algorithm).

The objective is the whole graph's modelled time: every operator's cost for its candidate
(compute plus its own communication: parameter-gradient all-reduces) and
every edge's redistribution between the candidates at its two ends. A parameter shared by two
operators adds an edge that forbids different layouts (infinite cost). Annotated operators keep
only their annotated candidate.

The graph is reduced by MindSpore's equivalent eliminations, each recorded to be undone:

* edge elimination: parallel edges between two operators are summed into one;
* operator elimination: an operator with exactly two neighbours is replaced by an edge between
  them, its cost minimised for every pair of their candidates (the residual branches of a
  transformer block are series-parallel, so they reduce this way);
* merge elimination: an operator with one neighbour is folded into that neighbour's cost.

When one operator is left per connected part, its best candidate is chosen and the
eliminations are undone in reverse, each recovering its operator's argmin. If some part does
not reduce (an operator with three or more neighbours on a cycle), its operators fall back to
sharding propagation from what was decided, and the plan says so. Costs are numpy arrays:
an edge is a ``[candidates of one end, candidates of the other]`` matrix.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any

import numpy as np

from parallel.auto.candidates import NO_SHARDS, OptimizerShards, annotated_candidate
from parallel.auto.cost_model import DeviceProfile
from parallel.auto.graph import OpNode
from parallel.auto.memory_limit import within_memory
from parallel.auto.propagate import Decision, PricedGraph
from parallel.auto.recompute_choice import LayerRecompute


def _edge_matrix(prices: PricedGraph, producer: int, consumer: int, k: int) -> np.ndarray:
    """Redistribution time for every (producer candidate, consumer candidate) pair."""
    outs = {}
    out_index = [outs.setdefault(c.made, len(outs))
                 for c in prices.options[producer]]
    needs = {}
    need_index = [needs.setdefault(c.inputs[k], len(needs)) for c in prices.options[consumer]]
    table = np.array([[prices.edge(consumer, k, made, need) for need in needs]
                      for made in outs])
    return table[np.ix_(out_index, need_index)]


def _tie_matrix(prices: PricedGraph, a: int, ka: int, b: int, kb: int) -> np.ndarray:
    left = [c.inputs[ka] for c in prices.options[a]]
    right = [c.inputs[kb] for c in prices.options[b]]
    return np.array([[0.0 if x == y else np.inf for y in right] for x in left])


class _Tables:
    """Node cost and memory vectors and edge matrices, built once per operator kind (and kind
    pair): the layers of a stack repeat, so a 96-layer model builds about one layer's tables.
    They do not depend on the memory price, so the limit's bisection reuses them too."""

    def __init__(self, prices: PricedGraph) -> None:
        self.prices = prices
        self.kind = [(kind, repr(op.annotated)) for kind, op in zip(prices.kind, prices.ops,
                                                                      strict=True)]
        self._nodes: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._edges: dict[tuple, np.ndarray] = {}

    def node(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        """(seconds, bytes) of each of operator ``j``'s candidates."""
        if self.kind[j] not in self._nodes:
            options = self.prices.options[j]
            self._nodes[self.kind[j]] = (
                np.array([self.prices.own(j, c) + c.compute for c in options]),
                np.array([c.memory for c in options]))
        return self._nodes[self.kind[j]]

    def edge(self, producer: int, consumer: int, k: int) -> np.ndarray:
        key = (self.kind[producer], self.kind[consumer], k,
               self.prices.ops[consumer].sources[k].kind)
        if key not in self._edges:
            self._edges[key] = _edge_matrix(self.prices, producer, consumer, k)
        return self._edges[key]


class _Graph:
    """Node costs and edge matrices, edges keyed by ``(a, b)`` with ``a < b``; a node's cost is
    its time plus ``price`` seconds per byte of memory it holds (the memory limit's Lagrange
    multiplier)."""

    def __init__(self, tables: _Tables, price: float = 0.0) -> None:
        prices = tables.prices
        n = len(prices.ops)
        self.node = []
        for j in range(n):
            seconds, memory = tables.node(j)
            self.node.append(seconds + price * memory if price else seconds.copy())
        self.edges: dict[tuple[int, int], np.ndarray] = {}
        self.adjacent: dict[int, set[int]] = {j: set() for j in range(n)}
        for j, op in enumerate(prices.ops):
            for k, src in enumerate(op.sources):
                if src.linked:
                    self.add(src.op, j, tables.edge(src.op, j, k))
        for pairs in prices.tied.values():
            for (a, ka), (b, kb) in zip(pairs, pairs[1:], strict=False):
                if a != b:
                    self.add(a, b, _tie_matrix(prices, a, ka, b, kb))

    def add(self, a: int, b: int, matrix: np.ndarray) -> None:
        """Add an edge (summing into an existing one: edge elimination)."""
        if a > b:
            a, b, matrix = b, a, matrix.T
        self.edges[(a, b)] = self.edges[(a, b)] + matrix if (a, b) in self.edges else matrix
        self.adjacent[a].add(b)
        self.adjacent[b].add(a)

    def matrix(self, a: int, b: int) -> np.ndarray:
        """The edge as ``[candidates of a, candidates of b]``."""
        return self.edges[(a, b)] if a < b else self.edges[(b, a)].T

    def remove(self, v: int) -> None:
        for u in self.adjacent.pop(v):
            self.adjacent[u].discard(v)
            self.edges.pop((min(u, v), max(u, v)))


def _eliminate(graph: _Graph) -> list[tuple[Any, ...]]:
    """Merge and operator eliminations until none applies; the undo records, in order."""
    undo: list[tuple[Any, ...]] = []
    queue = collections.deque(graph.adjacent)
    while queue:
        v = queue.popleft()
        if v not in graph.adjacent:
            continue
        around = sorted(graph.adjacent[v])
        if len(around) == 1:  # merge elimination: fold v into its one neighbour
            (u,) = around
            total = graph.matrix(u, v) + graph.node[v][None, :]
            undo.append(("merge", v, u, total.argmin(axis=1)))
            graph.node[u] = graph.node[u] + total.min(axis=1)
            graph.remove(v)
            queue.append(u)
        elif len(around) == 2:  # operator elimination: v becomes an edge u - w
            u, w = around
            total = (graph.matrix(u, v)[:, :, None] + graph.node[v][None, :, None]
                     + graph.matrix(v, w)[None, :, :])
            undo.append(("operator", v, u, w, total.argmin(axis=1)))
            graph.remove(v)
            graph.add(u, w, total.min(axis=1))
            queue.extend((u, w))
    return undo


def search(ops: list[OpNode], device_num: int, profile: DeviceProfile,
           max_device_memory: float | None = None, shards: OptimizerShards = NO_SHARDS,
           where: str = "", layouts: Mapping[str, tuple[int, ...]] | None = None,
           recompute: LayerRecompute | None = None) -> tuple[list[Decision], list[str]]:
    """The cheapest strategy of every operator under the cost model, holding at most
    ``max_device_memory`` bytes per device (``memory_limit.within_memory``); and notes
    (operators that did not reduce and were propagated instead, the runner-up, the price memory
    was given). ``recompute``: the graph's layers, each choosing its activation recompute under
    the limit too (``recompute_choice``)."""
    prices = PricedGraph(ops, device_num, profile, shards, layouts)
    for j, op in enumerate(ops):
        if op.annotated is not None:
            prices.options[j] = [annotated_candidate(op, profile, shards)]
    tables = _Tables(prices)
    return within_memory(lambda price: _search(tables, price), max_device_memory,
                         where or f"on {device_num} devices", recompute)


def _search(tables: _Tables, price: float) -> tuple[list[Decision], list[str]]:
    prices = tables.prices
    ops = prices.ops
    prices.decided = {}
    graph = _Graph(tables, price)
    undo = _eliminate(graph)
    roots = [v for v in graph.adjacent if not graph.adjacent[v]]  # one per reduced part
    chosen = _undo(undo, {v: int(graph.node[v].argmin()) for v in roots})
    notes = [_runner_up(ops, graph, undo, roots, chosen)] if price == 0.0 else []
    for j, index in chosen.items():
        how = "annotated" if ops[j].annotated is not None else "searched"
        prices.decided[j] = Decision(prices.options[j][index], how)
    for j in chosen:  # an unsatisfiable tie (annotations that disagree) costs infinity: name it
        prices.allowed(j, [prices.decided[j].candidate])
    left = [j for j in range(len(ops)) if j not in chosen]
    if left:  # cycles of three or more neighbours: propagation from what was decided
        names = ", ".join(ops[j].name for j in left[:5]) + (", ..." if len(left) > 5 else "")
        notes.append(f"{len(left)} operator(s) did not reduce ({names}): propagated instead")
        prices.run()
    return [prices.decided[j] for j in range(len(ops))], [n for n in notes if n]


def _undo(undo: list[tuple[Any, ...]], chosen: dict[int, int]) -> dict[int, int]:
    """Every eliminated operator's candidate, from the roots' choices back."""
    chosen = dict(chosen)
    for record in reversed(undo):
        if record[0] == "merge":
            _, v, u, best = record
            chosen[v] = int(best[chosen[u]])
        else:
            _, v, u, w, best = record
            chosen[v] = int(best[chosen[u], chosen[w]])
    return chosen


def _runner_up(ops: list[OpNode], graph: _Graph, undo: list[tuple[Any, ...]],
               roots: list[int], chosen: dict[int, int]) -> str:
    """The second-best plan the eliminations hold: the root whose second candidate is closest
    to its best, taken instead (a root's cost vector is its whole part's total)."""
    gaps = []
    for v in roots:
        costs = np.sort(graph.node[v])
        if len(costs) > 1 and np.isfinite(costs[1]):
            gaps.append((float(costs[1] - costs[0]), v))
    if not gaps:
        return ""
    gap, v = min(gaps)
    second = int(np.argsort(graph.node[v])[1])
    other = _undo(undo, {**{r: chosen[r] for r in roots}, v: second})
    differ = sorted(ops[j].name for j in chosen if other.get(j) != chosen[j])
    return (f"runner-up: {gap * 1e3:.3f} ms slower, differing at {len(differ)} operator(s) "
            f"({', '.join(differ[:4])}{', ...' if len(differ) > 4 else ''})")
