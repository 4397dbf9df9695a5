"""Sharding propagation (MindSpore's strategy broadcast): annotated operators fix their strategies;
every other operator takes, in breadth-first order from them, the candidate whose redistribution
with its already-decided neighbours costs least (ties: less compute, then less memory). An
undecided neighbour counts with the cheapest layout it could meet the candidate with (one step
of lookahead), so an operator does not split what its next consumer must gather again; and a
candidate that splits work a parameter is not split along pays the backward all-reduce of that
parameter's partial gradients.
Operators no annotation reaches are data parallel (their first input split on its first
dimension over every device, where it divides). A parameter several operators consume (tied
embedding and head) gets one layout: later operators only take candidates that agree with it.

A candidate assigns a power-of-two slice count to each dimension letter of the operator's rule
(letters the rule forbids splitting stay 1), using at most ``device_num`` devices. Its layouts
are kept as *split vectors* (slices per tensor dimension) plus the partial-sum factor of the
output (the slices of contracted letters); an edge's cost is the collectives that turn the
producer's output into the consumer's input: an all-reduce of partial sums, then an all-gather
per dimension the consumer splits less (splitting more is a local slice). Inputs fed by the
model's inputs or by parameters are free (laid out once); an input behind a node the planner
does not follow (a view, a permute) is priced as the producer's output gathered whole.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Iterator

from parallel.auto.cost_model import Comm, DeviceProfile
from parallel.auto.graph import OpNode
from parallel.semi_auto.rules import LAYER_NORM, LINEAR, Labels

#: strategy entries semi-auto takes per rule (Linear: input and weight, the bias follows)
_ENTRIES = {id(LINEAR): 2, id(LAYER_NORM): 1}


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One strategy of one operator, with its layouts and its compute and memory per device."""

    strategy: tuple[tuple[int, ...], ...]
    inputs: tuple[tuple[int, ...], ...]  # split vector per input
    output: tuple[int, ...]
    partial: int
    compute: float
    memory: float
    grad_sync: tuple[Comm, ...] = ()  # backward all-reduces of parameter gradients

    def sync_time(self, profile: DeviceProfile) -> float:
        return sum(c.time(profile) for c in self.grad_sync)


def _labels(op: OpNode) -> Labels:
    return op.rule.labels(tuple(len(s) for s in op.shapes), op.info)


def _letter_sizes(op: OpNode, labels: Labels) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for letters, shape in zip(labels.inputs, op.shapes, strict=False):
        for letter, size in zip(letters, shape[len(shape) - len(letters):], strict=True):
            sizes[letter] = max(sizes.get(letter, 1), size)
    return sizes


def _assignments(letters: list[str], sizes: dict[str, int], budget: int
                 ) -> Iterator[dict[str, int]]:
    if not letters:
        yield {}
        return
    first, rest = letters[0], letters[1:]
    slices = 1
    while slices <= budget and sizes[first] % slices == 0:
        for tail in _assignments(rest, sizes, budget // slices):
            yield {first: slices, **tail}
        slices *= 2


def _split(letters: str, shape: tuple[int, ...], slices: dict[str, int]) -> tuple[int, ...]:
    return tuple(slices[letter] if size > 1 else 1 for letter, size in zip(letters, shape,
                                                                         strict=True))


def _candidate(op: OpNode, labels: Labels, sizes: dict[str, int],
               slices: dict[str, int], profile: DeviceProfile) -> Candidate:
    inputs = tuple(_split(letters, shape, slices)
                   for letters, shape in zip(labels.inputs, op.shapes, strict=False))
    output = _split(labels.output, op.out_shape, slices)
    contracted = [letter for letter in sizes if letter not in labels.output]
    work = math.prod(sizes.values())
    flops = 2 * work if contracted else 5 * math.prod(op.out_shape)
    used = math.prod(slices.values())
    held = sum(math.prod(s) / math.prod(v) for s, v in zip(op.shapes, inputs, strict=True))
    held += math.prod(op.out_shape) / math.prod(output)
    entries = _ENTRIES.get(id(op.rule), len(inputs))
    sync = []  # a parameter used on split work gets partial gradients: all-reduced in backward
    for letters, shape, split, src in zip(labels.inputs, op.shapes, inputs, op.sources,
                                          strict=False):
        group = math.prod(n for letter, n in slices.items() if letter not in letters)
        if src.kind == "param" and group > 1:
            local = math.prod(shape) // math.prod(split) * op.itemsize
            sync.append(Comm("all_reduce", group, local))
    return Candidate(strategy=inputs[:entries], inputs=inputs, output=output,
                     partial=math.prod(slices[letter] for letter in contracted),
                     compute=flops / used / profile.flops, memory=held * op.itemsize,
                     grad_sync=tuple(sync))


def candidates(op: OpNode, device_num: int, profile: DeviceProfile) -> list[Candidate]:
    """Every strategy of ``op`` on at most ``device_num`` devices."""
    labels = _labels(op)
    sizes = _letter_sizes(op, labels)
    free = [letter for letter in sizes if letter not in labels.unsplit]
    found = []
    for chosen in _assignments(free, sizes, device_num):
        slices = {letter: chosen.get(letter, 1) for letter in sizes}
        found.append(_candidate(op, labels, sizes, slices, profile))
    return found


def annotated_candidate(op: OpNode, profile: DeviceProfile) -> Candidate:
    """The candidate of the user's ``in_strategy`` (slice tuples) for ``op``."""
    labels = _labels(op)
    sizes = _letter_sizes(op, labels)
    slices = dict.fromkeys(sizes, 1)
    for letters, entry in zip(labels.inputs, op.annotated, strict=False):
        for letter, count in zip(letters, tuple(entry)[len(entry) - len(letters):], strict=True):
            slices[letter] = max(slices[letter], count)
    return _candidate(op, labels, sizes, slices, profile)


def edge_comms(shape: tuple[int, ...], itemsize: int, produced: Candidate,
               needed: tuple[int, ...]) -> list[Comm]:
    """Collectives turning ``produced``'s output into the split ``needed``."""
    local = math.prod(shape) // max(math.prod(produced.output), 1) * itemsize
    comms = []
    if produced.partial > 1:
        comms.append(Comm("all_reduce", produced.partial, local))
    for have, want in zip(produced.output, needed, strict=True):
        if want < have:
            comms.append(Comm("all_gather", have // want, local))
            local *= have // want
    return comms


@dataclasses.dataclass
class Decision:
    """How an operator got its strategy: "annotated", "propagated" or "data parallel"."""

    candidate: Candidate
    how: str


class _Graph:
    """Consumers of each operator, split into exact edges and edges behind an opaque node."""

    def __init__(self, ops: list[OpNode]) -> None:
        self.ops = ops
        self.consumers: list[list[tuple[int, int]]] = [[] for _ in ops]
        self.opaque: list[int] = [0] * len(ops)
        for j, op in enumerate(ops):
            for k, src in enumerate(op.sources):
                if src.kind == "op":
                    self.consumers[src.op].append((j, k))
                elif src.kind == "opaque" and src.op is not None:
                    self.opaque[src.op] += 1

    def neighbours(self, i: int) -> list[int]:
        producers = [s.op for s in self.ops[i].sources if s.op is not None]
        return producers + [j for j, _ in self.consumers[i]]


def _opaque_cost(graph: _Graph, j: int, c: Candidate, profile: DeviceProfile) -> float:
    op = graph.ops[j]
    if not graph.opaque[j]:
        return 0.0
    whole = edge_comms(op.out_shape, op.itemsize, c, (1,) * len(op.out_shape))
    return graph.opaque[j] * sum(x.time(profile) for x in whole)


def _edge_time(graph: _Graph, producer: Candidate, consumer: int, k: int,
               needed: Candidate, profile: DeviceProfile) -> float:
    op = graph.ops[consumer]
    comms = edge_comms(op.shapes[k], op.itemsize, producer, needed.inputs[k])
    return sum(x.time(profile) for x in comms)


def _lookahead(graph: _Graph, j: int, c: Candidate, decided: dict[int, Decision],
               options: list[list[Candidate]], profile: DeviceProfile) -> float:
    """For each undecided neighbour, the cheapest way it could meet ``c``: its edge with ``c``,
    its own parameter-gradient all-reduces, and what its output would cost behind an opaque
    node (one step of lookahead, so that an operator does not split a tensor its next consumer
    must gather again)."""
    total = 0.0
    op = graph.ops[j]
    for k, src in enumerate(op.sources):  # undecided producers
        if src.kind == "op" and src.op not in decided:
            total += min(_edge_time(graph, p, j, k, c, profile) + p.sync_time(profile)
                         + _opaque_cost(graph, src.op, p, profile) for p in options[src.op])
    for m, k in graph.consumers[j]:  # undecided consumers
        if m not in decided:
            total += min(_edge_time(graph, c, m, k, n, profile) + n.sync_time(profile)
                         + _opaque_cost(graph, m, n, profile) for n in options[m])
    return total


def _cost(graph: _Graph, j: int, c: Candidate, decided: dict[int, Decision],
          profile: DeviceProfile) -> float:
    op = graph.ops[j]
    total = 0.0
    for k, src in enumerate(op.sources):
        if src.kind == "op" and src.op in decided:
            comms = edge_comms(op.shapes[k], op.itemsize, decided[src.op].candidate, c.inputs[k])
            total += sum(x.time(profile) for x in comms)
    for m, k in graph.consumers[j]:
        if m in decided:
            comms = edge_comms(graph.ops[m].shapes[k], op.itemsize, c,
                               decided[m].candidate.inputs[k])
            total += sum(x.time(profile) for x in comms)
    return total + _opaque_cost(graph, j, c, profile)


def _data_parallel(op: OpNode, options: list[Candidate], device_num: int) -> Candidate:
    def batch_only(c: Candidate) -> bool:
        first = c.inputs[0]
        return first[0] == device_num and all(s == 1 for s in first[1:]) and c.partial == 1
    return next((c for c in options if batch_only(c)), options[0])  # options[0]: all ones


def _tied(ops: list[OpNode]) -> dict[str, list[tuple[int, int]]]:
    """Parameter name -> the (operator, input) pairs that consume it, for shared parameters."""
    users: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
    for j, op in enumerate(ops):
        for k, src in enumerate(op.sources):
            if src.kind == "param":
                users[src.param].append((j, k))
    return {name: pairs for name, pairs in users.items() if len(pairs) > 1}


def _allowed(j: int, options: list[Candidate], ops: list[OpNode],
             tied: dict[str, list[tuple[int, int]]], decided: dict[int, Decision]
             ) -> list[Candidate]:
    """``options`` that lay a shared parameter out as its decided consumers do (a parameter has
    one layout); ValueError naming both operators when none can."""
    allowed = options
    for k, src in enumerate(ops[j].sources):
        for i, k_i in tied.get(src.param, []) if src.kind == "param" else []:
            if i == j or i not in decided:
                continue
            need = decided[i].candidate.inputs[k_i]
            allowed = [c for c in allowed if c.inputs[k] == need]
            if not allowed:
                raise ValueError(
                    f"auto parallel: parameter '{src.param}' is shared by operators "
                    f"'{ops[i].name}' ({ops[i].key or 'functional'}) and '{ops[j].name}' "
                    f"({ops[j].key or 'functional'}); the first lays it out as {need}, which "
                    f"no strategy of the second reconciles; annotate them alike")
    return allowed


def propagate(ops: list[OpNode], device_num: int, profile: DeviceProfile
              ) -> list[Decision]:
    """Every operator's decision (see the module docstring)."""
    graph = _Graph(ops)
    tied = _tied(ops)
    options = [candidates(op, device_num, profile) for op in ops]
    decided: dict[int, Decision] = {}
    for i, op in enumerate(ops):
        if op.annotated is not None:
            chosen = annotated_candidate(op, profile)
            _allowed(i, [chosen], ops, tied, decided)  # annotations must agree on ties
            decided[i] = Decision(chosen, "annotated")
    queue = collections.deque(sorted(decided))
    while queue:
        i = queue.popleft()
        for j in graph.neighbours(i):
            if j in decided:
                continue
            best = min(_allowed(j, options[j], ops, tied, decided), key=lambda c, j=j: (
                _cost(graph, j, c, decided, profile) + c.sync_time(profile)
                + _lookahead(graph, j, c, decided, options, profile), c.compute, c.memory))
            decided[j] = Decision(best, "propagated")
            queue.append(j)
    for i, op in enumerate(ops):
        if i not in decided:
            allowed = _allowed(i, options[i], ops, tied, decided)
            decided[i] = Decision(_data_parallel(op, allowed, device_num), "data parallel")
    return [decided[i] for i in range(len(ops))]
