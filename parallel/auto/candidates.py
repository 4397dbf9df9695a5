"""The candidates every search chooses among: one strategy of one operator, with its layouts,
compute, memory and own communication (:class:`Candidate`), and the collectives between two
layouts (:func:`edge_comms`).

A candidate assigns a power-of-two slice count to each dimension letter of the operator's rule
(letters the rule forbids splitting stay 1), using at most ``device_num`` devices. Its layouts
are kept as *split vectors* (slices per tensor dimension) plus the partial-sum factor of the
output (the slices of contracted letters); an edge's cost is the collectives that turn the
producer's output into the consumer's input: an all-reduce of partial sums, then an all-gather
per dimension the consumer splits less (splitting more is a local slice). Inputs fed by the
model's inputs or by parameters are free (laid out once). An operator whose output a node the
planner does not follow reshapes (a view, a permute) may split that output along its first,
batch, dimension only, with no partial sums: the view keeps the batch dimension, and DTensor
refuses to reshape a dimension that does not split evenly (``PricedGraph.permits``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator

from parallel.auto.cost_model import Comm, DeviceProfile
from parallel.auto.graph import OpNode
from parallel.semi_auto.rules import LAYER_NORM, LINEAR, SDPA, Labels

#: copies of a parameter a device holds while training: weight, gradient, Adam's two moments
PARAM_COPIES = 4
#: a training step computes each operator's forward once and its backward (about twice the
#: forward's FLOPs) once: candidates' compute is that step's, as their collectives are
TRAINING_PASSES = 3


@dataclasses.dataclass(frozen=True)
class OptimizerShards:
    """A data axis under the plan: ``data`` ranks of the stage split the batch (each feeding its
    own slice under ``full_batch=False``) and hold replicas of every parameter slice, among
    which optimizer parallel shards the Adam moments (``level1``), also the gradients
    (``level2``) and also the weights (``level3``); ``level`` None: no optimizer parallel.
    ``data > 1`` makes a
    constraint of the search: every operator splits its batch (first input's first dimension)
    by a multiple of ``data`` and no parameter over more than ``device_num / data`` devices,
    which is the layout optimizer parallel shards (the semi-auto mesh's outer data dims)."""

    data: int = 1
    level: str | None = None

    def held(self, params: float) -> float:
        """Elements a device holds for ``params`` parameter-slice elements: weight, gradient
        and two moments, each divided by ``data`` where this level shards it."""
        if self.level is None:
            return PARAM_COPIES * params
        sharded = {"level1": 2, "level2": 3, "level3": 4}[self.level]
        return params * ((PARAM_COPIES - sharded) + sharded / self.data)


NO_SHARDS = OptimizerShards()
#: strategy entries semi-auto takes per rule (Linear: input and weight, the bias follows)
_ENTRIES = {id(LINEAR): 2, id(LAYER_NORM): 1}


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One strategy of one operator, with its layouts and its compute and memory per device.

    Where its slices sit on the ranks (for pricing on a two-level cluster) follows semi-auto's
    device matrix: one axis per dimension letter in order of first appearance, row-major, so a
    letter's rank stride is the product of the slices of the letters after it.
    ``out_strides``/``in_strides`` hold that stride per tensor dimension (1 where unsplit),
    ``partial_axes`` the (slices, stride) of the contracted letters the output is partial
    over."""

    strategy: tuple[tuple[int, ...], ...]
    inputs: tuple[tuple[int, ...], ...]  # split vector per input
    output: tuple[int, ...]
    partial: int
    compute: float
    memory: float  # bytes per device: parameter slices (x PARAM_COPIES) and the output slice
    grad_sync: tuple[Comm, ...] = ()  # backward all-reduces of partial gradients
    sync_seconds: float = 0.0  # their modelled time
    out_strides: tuple[int, ...] = ()
    partial_axes: tuple[tuple[int, int], ...] = ()
    in_strides: tuple[tuple[int, ...], ...] = ()

    @functools.cached_property
    def made(self) -> Made:
        """What an edge from this operator starts from: its output's layout and placement
        (made once: the searches ask for it in every price)."""
        return Made(self.output, self.partial, self.out_strides, self.partial_axes)

    def needs(self, k: int) -> Made:
        """Input ``k``'s layout as a producer would have to make it to need no collective."""
        strides = self.in_strides[k] if k < len(self.in_strides) else ()
        return Made(self.inputs[k], 1, strides, ())


@dataclasses.dataclass(frozen=True)
class Made:
    """A produced tensor's layout: split vector, partial-sum factor, and where they sit (the
    rank stride of each split dimension, the axes of the partial sums; empty: consecutive)."""

    output: tuple[int, ...]
    partial: int = 1
    strides: tuple[int, ...] = ()
    partial_axes: tuple[tuple[int, int], ...] = ()


def whole(rank: int) -> Made:
    """A replicated tensor of ``rank`` dimensions."""
    return Made((1,) * rank)


def _labels(op: OpNode) -> Labels:
    return op.rule.labels(tuple(len(s) for s in op.shapes), op.info)


def _letter_sizes(op: OpNode, labels: Labels) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for letters, shape in zip(labels.inputs, op.shapes, strict=False):
        for letter, size in zip(letters, shape[len(shape) - len(letters):], strict=True):
            sizes[letter] = max(sizes.get(letter, 1), size)
    return sizes


def _work(op: OpNode, labels: Labels, sizes: dict[str, int]) -> int:
    """Multiply-adds of the forward: the product of every letter's size for one contraction
    (a Linear's tokens x in x out). Attention is two contractions, query x key over the head
    dimension ``d``, then the weights x value over ``s``: lead x t x s x (d + e); one product
    of all six letters counted d x e / (d + e) times too many (16x at head size 32), so a plan
    that keeps attention whole was priced far above its measured step."""
    if op.rule is SDPA:
        lead = math.prod(sizes[letter] for letter in labels.output[:-2])
        return lead * sizes["t"] * sizes["s"] * (sizes["d"] + sizes["e"])
    return math.prod(sizes.values())


def _compute(op: OpNode, labels: Labels, sizes: dict[str, int], contracted: list[str],
             profile: DeviceProfile) -> float:
    """Seconds of the operator's training-step work on one device, unsplit: the forward's, and
    the backward's two products (the input's and the parameters' gradients) at the profile's
    FLOP/s (attention at its own where measured); an elementwise or normalisation operator at
    its measured seconds per element, or else as 5 FLOPs per element each pass (its backward
    reads and writes as much again)."""
    if contracted:
        rate = profile.attention_flops if op.rule is SDPA and profile.attention_flops > 0 \
            else profile.flops
        return TRAINING_PASSES * 2 * _work(op, labels, sizes) / rate
    elements = math.prod(op.out_shape)
    measured = profile.element_seconds(op.target) if op.target else None
    if measured is not None:
        return elements * measured
    return TRAINING_PASSES * 5 * elements / profile.flops


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


def _strides(letters: str, shape: tuple[int, ...], slices: dict[str, int],
             stride: dict[str, int]) -> tuple[int, ...]:
    return tuple(stride[letter] if size > 1 and slices[letter] > 1 else 1
                 for letter, size in zip(letters, shape, strict=True))


def _candidate(op: OpNode, labels: Labels, sizes: dict[str, int],
               slices: dict[str, int], profile: DeviceProfile,
               shards: OptimizerShards = NO_SHARDS) -> Candidate:
    inputs = tuple(_split(letters, shape, slices)
                   for letters, shape in zip(labels.inputs, op.shapes, strict=False))
    output = _split(labels.output, op.out_shape, slices)
    order = list(sizes)  # letters in order of first appearance: the device matrix's axes
    stride = {letter: math.prod(slices[m] for m in order[i + 1:])
              for i, letter in enumerate(order)}
    contracted = [letter for letter in sizes if letter not in labels.output]
    used = math.prod(slices.values())
    compute = _compute(op, labels, sizes, contracted, profile) / used + profile.dispatch
    # per device: each parameter slice with its gradient and two Adam moments (the share
    # optimizer parallel leaves), and the output slice kept for backward
    params = sum(math.prod(shape) / math.prod(split) for shape, split, src
                 in zip(op.shapes, inputs, op.sources, strict=False) if src.kind == "param")
    held = shards.held(params) + math.prod(op.out_shape) / math.prod(output)
    entries = _ENTRIES.get(id(op.rule), len(inputs))
    # a parameter used on split work gets partial gradients: all-reduced in backward; so does
    # an activation (Megatron's "f": a column-parallel layer's replicated input)
    sync = []
    for letters, shape, split, src in zip(labels.inputs, op.shapes, inputs, op.sources,
                                          strict=False):
        axes = tuple((n, stride[letter]) for letter, n in slices.items()
                     if letter not in letters and n > 1)
        group = math.prod(n for n, _ in axes)
        local = math.prod(shape) // math.prod(split) * op.itemsize
        if group > 1 and (src.kind == "param" or src.linked):
            # (optimizer parallel's reduce-scatter + all-gather of the update costs the same)
            sync.append(Comm("all_reduce", group, local, backward=True, axes=axes))
        if src.kind == "param" and shards.level == "level3" and shards.data > 1:
            # weights sharded over the data ranks (the outer part of the batch letter's axis)
            # are gathered for forward and for backward
            batch = labels.inputs[0][0]
            outer = ((shards.data, stride[batch] * slices[batch] // shards.data),)
            sync += [Comm("all_gather", shards.data, local // shards.data, axes=outer)] * 2
    return Candidate(strategy=inputs[:entries], inputs=inputs, output=output,
                     partial=math.prod(slices[letter] for letter in contracted),
                     compute=compute, memory=held * op.itemsize,
                     grad_sync=tuple(sync), sync_seconds=sum(c.time(profile) for c in sync),
                     out_strides=_strides(labels.output, op.out_shape, slices, stride),
                     partial_axes=tuple((slices[letter], stride[letter]) for letter in contracted
                                        if slices[letter] > 1),
                     in_strides=tuple(_strides(letters, shape, slices, stride) for letters, shape
                                      in zip(labels.inputs, op.shapes, strict=False)))


def candidates(op: OpNode, device_num: int, profile: DeviceProfile,
               fully_use_devices: bool = True,
               shards: OptimizerShards = NO_SHARDS) -> list[Candidate]:
    """The strategies of ``op``: using all ``device_num`` devices (MindSpore's
    ``fully_use_devices``; plus the replicated one, always possible), or with
    ``fully_use_devices=False`` any number up to it. The replicated one comes first. On a
    two-level cluster (a ``ClusterProfile``) a strategy may also use one node's devices,
    repeated on every node (semi-auto's leading repeat axis: the slices sit on consecutive
    ranks), so work split over the fast links alone is a candidate too."""
    labels = _labels(op)
    sizes = _letter_sizes(op, labels)
    free = [letter for letter in sizes if letter not in labels.unsplit]
    cluster = getattr(profile, "cluster", None)
    node = cluster.devices_per_node if cluster is not None else device_num
    found = []
    for chosen in _assignments(free, sizes, device_num):
        used = math.prod(chosen.values())
        if fully_use_devices and used not in (1, node, device_num):
            continue
        slices = {letter: chosen.get(letter, 1) for letter in sizes}
        found.append(_candidate(op, labels, sizes, slices, profile, shards))
    return found


def annotated_candidate(op: OpNode, profile: DeviceProfile,
                        shards: OptimizerShards = NO_SHARDS) -> Candidate:
    """The candidate of the user's ``in_strategy`` (slice tuples) for ``op``."""
    labels = _labels(op)
    sizes = _letter_sizes(op, labels)
    slices = dict.fromkeys(sizes, 1)
    for letters, entry in zip(labels.inputs, op.annotated, strict=False):
        for letter, count in zip(letters, tuple(entry)[len(entry) - len(letters):], strict=True):
            slices[letter] = max(slices[letter], count)
    return _candidate(op, labels, sizes, slices, profile, shards)


def arriving(consumer: OpNode, k: int, made: Made) -> Made:
    """The layout a producer's output ``made`` has when it reaches ``consumer``'s input ``k``:
    itself, or, behind a view the planner does not follow (a reshape, a permute: an "opaque"
    source), the consumer's shape split along its first (batch) dimension as the producer's
    output was: the only split such a producer may have (``PricedGraph.permits``), which a
    view keeps. So a consumer that splits the batch less pays the gather DTensor runs."""
    if consumer.sources[k].kind != "opaque":
        return made
    rest = len(consumer.shapes[k]) - 1
    stride = made.strides[0] if made.strides else 1
    return Made((made.output[0], *(1,) * rest), 1, (stride, *(1,) * rest))


def edge_comms(shape: tuple[int, ...], itemsize: int, made: Made,
               needed: tuple[int, ...]) -> list[Comm]:
    """Collectives turning a producer's layout ``made`` (its split, holding sums over
    ``partial`` devices) into the split ``needed``, and their mirrors in the backward pass: a
    gather's gradient is reduce-scattered back; a reduction of partial sums needs none (the
    gradient of a sum is the same on every rank). Each collective's group sits where the
    producer's slices do (a gather over the inner part of its dimension's axis)."""
    output = made.output
    local = math.prod(shape) // max(math.prod(output), 1) * itemsize
    comms = []
    if made.partial > 1:
        comms.append(Comm("all_reduce", made.partial, local, axes=made.partial_axes))
    for d, (have, want) in enumerate(zip(output, needed, strict=True)):
        if want < have:
            stride = made.strides[d] if d < len(made.strides) else 1
            axes = ((have // want, stride),)
            comms.append(Comm("all_gather", have // want, local, axes=axes))
            local *= have // want
            comms.append(Comm("reduce_scatter", have // want, local, backward=True, axes=axes))
    return comms
