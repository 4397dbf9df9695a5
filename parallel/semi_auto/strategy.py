"""Validate a shard strategy and derive every tensor's layout from it (the reference's rules).

A strategy has one entry per operator input: a tuple of slice counts, one per dimension
(``((2, 1), (1, 2))`` for MatMul), or a ``TensorLayout`` from ``Layout``. From the
operator's rule (``rules.py``) this derives, as the reference's distributed operators do:

* the device matrix: one axis per dimension letter in order of first appearance, sized by its
  slices (MatMul ``((a, b), (b, c))`` gives ``(a, b, c)``), with a leading repeat axis when the
  product is smaller than the device count (those devices compute the same slices);
* each input's tensor map (axes counted from the right; -1 for a broadcast dimension);
* the output's tensor map, and the axes it holds partial sums over (letters summed away);
* with ``out_strategy``, where those partial sums go: the derived slices mean AllReduce, one
  dimension multiplied by the contracting slices means ReduceScatter into it.

Every check runs before anything is changed, and each error names the operator and the rule.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from parallel.semi_auto.layout import TensorLayout, as_dim_map, dim_axes
from parallel.semi_auto.rules import Labels, OpRule


@dataclasses.dataclass(frozen=True)
class OpPlan:
    """The layouts one tagged operator or module works with."""

    what: str
    rule: OpRule
    labels: Labels
    device_matrix: tuple[int, ...]
    inputs: tuple[TensorLayout, ...]  # one per rule input, strategy entries first
    output: TensorLayout  # as computed: may hold partial sums
    out: TensorLayout  # after out_strategy (the output itself when there is none)
    slices: dict[str, int]  # slices per dimension letter
    local: bool  # each rank may run the plain operator on its slices

    def describe_inputs(self) -> list[tuple[str, TensorLayout]]:
        return list(zip(self.rule.input_names, self.inputs, strict=True))


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_tuple(what: str, where: str, entry: Any) -> tuple[int, ...]:
    if not isinstance(entry, (tuple, list)) or not entry:
        raise ValueError(f"{what}: {where} = {entry!r} must be a non-empty tuple of slice counts, "
                         f"one per dimension")
    for value in entry:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{what}: {where} = {tuple(entry)} has {value!r}, which is not a "
                             f"positive integer (each entry is the number of slices)")
        if not _is_power_of_two(value):
            raise ValueError(f"{what}: {where} = {tuple(entry)} has {value}, which is not a power "
                             f"of two (a dimension is cut into 2^N slices)")
    return tuple(entry)


def normalise_strategy(what: str, rule: OpRule, in_strategy: Any) -> tuple:
    """Entries checked one by one: all slice tuples or all TensorLayouts, arity matching."""
    if isinstance(in_strategy, TensorLayout) or not isinstance(in_strategy, (tuple, list)):
        raise ValueError(f"{what}: in_strategy must be a tuple with one entry per input "
                         f"({', '.join(rule.input_names)}), got {in_strategy!r}")
    if not rule.accepts(len(in_strategy)):
        counts = rule.arity or tuple(range(1, len(rule.input_names) + 1))
        raise ValueError(f"{what}: in_strategy has {len(in_strategy)} entries, but {rule.name} "
                         f"takes {' or '.join(map(str, counts))} (inputs: "
                         f"{', '.join(rule.input_names)})")
    layouts = [isinstance(e, TensorLayout) for e in in_strategy]
    if any(layouts) and not all(layouts):
        raise ValueError(f"{what}: in_strategy mixes slice tuples and Layouts; use one kind")
    if all(layouts):
        return tuple(in_strategy)
    return tuple(_check_tuple(what, f"in_strategy[{i}]", e) for i, e in enumerate(in_strategy))


def derive_plan(what: str, rule: OpRule, in_strategy: Any, out_strategy: Any,
                device_num: int | None, info: dict[str, Any] | None = None) -> OpPlan:
    """All layouts of one operator; ``device_num`` None checks everything but the device count."""
    strategy = normalise_strategy(what, rule, in_strategy)
    ranks = tuple(e.rank if isinstance(e, TensorLayout) else len(e) for e in strategy)
    try:
        labels = rule.labels(ranks, info or {})
    except ValueError as err:
        raise ValueError(f"{what}: {err}") from None
    for i, (entry_rank, letters) in enumerate(zip(ranks, labels.inputs, strict=False)):
        if entry_rank != len(letters):
            raise ValueError(f"{what}: in_strategy[{i}] has {entry_rank} entries, but "
                             f"{rule.name}'s {rule.input_names[i]} here has {len(letters)} "
                             f"dimensions")
    if isinstance(strategy[0], TensorLayout):
        core, axes = _axes_from_layouts(what, rule, labels, strategy)
    else:
        core, axes = _axes_from_tuples(what, rule, labels, strategy)
    size = math.prod(core)
    if device_num is not None and device_num % size:
        raise ValueError(f"{what}: the strategy uses {size} devices (device matrix {core}), "
                         f"which does not divide the device count {device_num}")
    repeat = device_num // size if device_num else 1
    matrix = (repeat, *core) if repeat > 1 else core
    sizes = {letter: math.prod(matrix[len(matrix) - 1 - a] for a in ax)
             for letter, ax in axes.items()}
    for letter, why in labels.unsplit.items():
        if sizes.get(letter, 1) > 1:
            raise ValueError(f"{what}: {why}; the strategy cuts it into {sizes[letter]}")
    inputs = tuple(_input_layout(matrix, axes, sizes, letters, strategy, i)
                   for i, letters in enumerate(labels.inputs))
    summed = [a for letter in axes if letter not in labels.output for a in axes[letter]
              if matrix[len(matrix) - 1 - a] > 1]
    output = TensorLayout(matrix, tuple(as_dim_map(axes[c]) for c in labels.output),
                          tuple(sorted(summed, reverse=True)))
    local = rule.local(sizes)
    if out_strategy is not None:
        out = _out_layout(what, output, out_strategy)
    elif not local and output.partial:
        # DTensor's masked partial lookup must be reduced before any other op sees it
        out = dataclasses.replace(output, partial=())
    else:
        out = output
    return OpPlan(what, rule, labels, matrix, inputs, output, out, sizes, local)


def _axes_from_tuples(what: str, rule: OpRule, labels: Labels,
                      strategy: tuple) -> tuple[tuple[int, ...], dict[str, tuple[int, ...]]]:
    slices: dict[str, int] = {}
    seen: dict[str, str] = {}
    for i, entry in enumerate(strategy):
        for dim, (letter, n) in enumerate(zip(labels.inputs[i], entry, strict=True)):
            here = f"{rule.input_names[i]} dim {dim}"
            if letter not in slices or slices[letter] == n:
                slices.setdefault(letter, n)
                seen.setdefault(letter, here)
            elif letter in labels.broadcast and 1 in (slices[letter], n):
                slices[letter] = max(slices[letter], n)
            elif letter not in labels.output:
                raise ValueError(f"{what}: inconsistent contracting dimensions: {seen[letter]} "
                                 f"is cut into {slices[letter]} but {here} into {n}; every input "
                                 f"must cut it alike (MatMul ((a, b), (c, d)) needs b == c)")
            else:
                raise ValueError(f"{what}: {seen[letter]} is cut into {slices[letter]} but "
                                 f"{here}, the same dimension of {rule.name}, into {n}")
    order = list(slices)
    for letters in labels.inputs[len(strategy):]:  # inputs the strategy leaves out (bias)
        order += [c for c in letters if c not in order]
    core = tuple(slices.get(c, 1) for c in order)
    return core, {c: (len(order) - 1 - k,) for k, c in enumerate(order)}


def _axes_from_layouts(what: str, rule: OpRule, labels: Labels,
                       strategy: tuple) -> tuple[tuple[int, ...], dict[str, tuple[int, ...]]]:
    matrix = strategy[0].device_matrix
    if any(e.device_matrix != matrix for e in strategy):
        raise ValueError(f"{what}: the Layouts of one strategy must share a device matrix, got "
                         f"{[e.device_matrix for e in strategy]}")
    axes: dict[str, tuple[int, ...]] = {}
    for i, entry in enumerate(strategy):
        for dim, (letter, dim_map) in enumerate(zip(labels.inputs[i], entry.tensor_map,
                                                        strict=True)):
            got = dim_axes(dim_map)
            have = axes.setdefault(letter, got)
            if have != got and not (letter in labels.broadcast and () in (have, got)):
                kind = "contracting dimensions" if letter not in labels.output else "dimensions"
                raise ValueError(f"{what}: inconsistent {kind}: {rule.input_names[i]} dim {dim} "
                                 f"is mapped to axes {got}, another input's same dimension to "
                                 f"{have}")
            axes[letter] = have or got
    used = [a for ax in axes.values() for a in ax]
    if len(used) != len(set(used)):
        raise ValueError(f"{what}: one device axis slices two different dimensions ({axes})")
    for letters in labels.inputs[len(strategy):]:
        for c in letters:
            axes.setdefault(c, ())
    return matrix, axes


def _input_layout(matrix: tuple[int, ...], axes: dict[str, tuple[int, ...]],
                  sizes: dict[str, int], letters: str, strategy: tuple, i: int) -> TensorLayout:
    dims = []
    for dim, letter in enumerate(letters):
        if i < len(strategy) and not isinstance(strategy[i], TensorLayout):
            broadcast = strategy[i][dim] != sizes[letter]  # 1 where the others are cut
        elif i < len(strategy):
            broadcast = not dim_axes(strategy[i].tensor_map[dim])
        else:
            broadcast = False
        dims.append(-1 if broadcast else as_dim_map(axes[letter]))
    return TensorLayout(matrix, tuple(dims))


def _out_layout(what: str, output: TensorLayout, out_strategy: Any) -> TensorLayout:
    if not isinstance(out_strategy, (tuple, list)) or len(out_strategy) != 1:
        raise ValueError(f"{what}: out_strategy must be a tuple holding one slice tuple for the "
                         f"output, got {out_strategy!r}")
    wanted = _check_tuple(what, "out_strategy[0]", out_strategy[0])
    derived = output.slices()
    if len(wanted) != len(derived):
        raise ValueError(f"{what}: out_strategy[0] = {wanted} has {len(wanted)} entries, but "
                         f"the output has {len(derived)} dimensions")
    partial_size = math.prod(output.axis_size(a) for a in output.partial)
    grown = [d for d, (w, s) in enumerate(zip(wanted, derived, strict=True)) if w != s]
    if not grown:
        return dataclasses.replace(output, partial=())  # AllReduce the partial sums
    if len(grown) == 1 and output.partial and wanted[grown[0]] == derived[grown[0]] * partial_size:
        d = grown[0]
        merged = sorted(dim_axes(output.tensor_map[d]) + output.partial, reverse=True)
        tensor_map = list(output.tensor_map)
        tensor_map[d] = as_dim_map(merged)
        return TensorLayout(output.device_matrix, tuple(tensor_map))  # ReduceScatter into d
    raise ValueError(f"{what}: out_strategy[0] = {wanted} is not reachable from the derived "
                     f"output {derived} (partial sums over {partial_size} slices): keep the "
                     f"derived slices (AllReduce) or multiply one dimension by {partial_size} "
                     f"(ReduceScatter)")


def check_shapes(plan: OpPlan, tensors: Sequence[Any]) -> None:
    """Each present input has its strategy's rank, and every split dimension divides evenly."""
    for i, (tensor, layout) in enumerate(zip(tensors, plan.inputs, strict=False)):
        if tensor is None or not isinstance(tensor, torch.Tensor):
            continue
        name = plan.rule.input_names[i]
        if tensor.dim() != layout.rank:
            raise ValueError(f"{plan.what}: {name} has {tensor.dim()} dimensions "
                             f"{tuple(tensor.shape)}, but its layout has {layout.rank}")
        for dim, (size, n) in enumerate(zip(tensor.shape, layout.slices(), strict=True)):
            if size % n:
                raise ValueError(f"{plan.what}: dimension {dim} of {name} (size {size}) is not "
                                 f"divisible by its {n} slices")
            letter = plan.labels.inputs[i][dim]
            if layout.tensor_map[dim] == -1 and plan.slices[letter] > 1 and size != 1:
                raise ValueError(f"{plan.what}: dimension {dim} of {name} (size {size}) is not "
                                 f"split, but the same dimension of another input is cut into "
                                 f"{plan.slices[letter]}; only a broadcast dimension (size 1) "
                                 f"may differ")
