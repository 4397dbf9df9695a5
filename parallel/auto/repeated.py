"""Capture a stack of repeated layers once: the planning graph of a 96-layer model from a 3-layer
capture.

``torch.export`` on fake tensors costs about 50 ms per transformer layer, so capturing every layer
dominated planning a deep model (6.7 s end to end for 96 layers against 0.3 s of search). The
layers of an ``nn.ModuleList`` whose children are all of one class with the same parameter and
buffer names, shapes and dtypes and the same annotations (module tags and ``parallel.shard``
operators) are assumed to run the same operators; the list is cut to its first three layers for
the capture and the graph is rebuilt for all of them:

* layer 0 as captured (it reads what precedes the stack);
* layers 1 .. n-2 as copies of layer 1 (reading the layer before them);
* layer n-1 as a copy of layer 2 (the last layer: what follows the stack reads it);
* the operators after the stack as captured, their inputs from the stack moved to the last layer.

A copy renames the module paths, operator keys and parameter names (``blocks.1.`` ->
``blocks.i.``), moves every input index inside the stack by whole layers, and renumbers each fx
node name by the stride its name base advances per layer (``linear_4`` -> ``linear_{4 + 4(i-1)}``),
so the graph equals the full capture's operator for operator. The assumption is checked on the
capture itself: layer 2 must be layer 1 moved by one layer (same operators, shapes and
annotations, inputs one layer on, names one stride on) and nothing after the stack may read a
layer but the last; otherwise — or when the model's forward does not run on a shorter list — the
whole model is captured, as before. ``tests/test_auto_repeated.py`` checks the graph and the plans
equal the full capture's.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import re
from collections.abc import Callable, Iterator

from torch import nn

from parallel.auto.graph import OpNode, Source
from parallel.semi_auto.shard import module_tag
from parallel.semi_auto.trace import sharded_ops

#: layers captured (the first reads the stack's input, the last feeds what follows)
CAPTURED = 3
_NAME = re.compile(r"^(.*)_(\d+)$")


def _layer_signature(layer: nn.Module) -> tuple:
    """What must agree for two layers to run the same operators: class, parameters, buffers
    and annotations."""
    tensors = tuple((n, tuple(t.shape), t.dtype) for n, t in
                    (*layer.named_parameters(), *layer.named_buffers()))
    tags = tuple((path, type(m).__name__, repr(getattr(module_tag(m), "in_strategy", None)))
                 for path, m in layer.named_modules())
    ops = tuple((path, repr(op.in_strategy)) for path, op in sharded_ops(layer))
    return type(layer), tensors, tags, ops


def repeated_stack(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The ``nn.ModuleList`` of more than ``CAPTURED`` alike layers holding the most parameters
    (its path and itself), or None."""
    best, most = None, 0
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) <= CAPTURED or not path:
            continue
        first = _layer_signature(module[0])
        if any(_layer_signature(layer) != first for layer in module[1:]):
            continue
        size = sum(math.prod(s) for _, s, _ in first[1]) * len(module)
        if size > most:
            best, most = (path, module), size
    return best


def _split_name(name: str) -> tuple[str, int]:
    found = _NAME.match(name)
    return (found.group(1), int(found.group(2))) if found else (name, 0)


def _join_name(base: str, number: int) -> str:
    return f"{base}_{number}" if number else base


class _Layers:
    """The captured graph cut into what precedes the stack, its layers and what follows."""

    def __init__(self, ops: list[OpNode], path: str) -> None:
        self.ops, self.path = ops, path
        spans = []
        for i in range(CAPTURED):
            prefix = f"{path}.{i}"
            mine = [j for j, op in enumerate(ops)
                    if op.module == prefix or op.module.startswith(prefix + ".")]
            spans.append(mine)
        self.valid = all(spans) and all(
            mine == list(range(mine[0], mine[0] + len(mine))) for mine in spans) and \
            spans[1][0] == spans[0][-1] + 1 and spans[2][0] == spans[1][-1] + 1 and \
            len({len(mine) for mine in spans}) == 1
        if not self.valid:
            return
        self.start, self.width = spans[0][0], len(spans[0])
        self.end = self.start + CAPTURED * self.width  # first operator after the stack
        # name strides: how far each fx name base advances per layer
        self.stride: dict[str, int] = {}
        for a, b in zip(ops[self.start + self.width:self.end - self.width],
                        ops[self.start + 2 * self.width:self.end], strict=True):
            (base, n), (other, m) = _split_name(a.name), _split_name(b.name)
            if base != other or self.stride.setdefault(base, m - n) != m - n:
                self.valid = False
                return
        for a, b in zip(ops[self.start:self.start + self.width],
                        ops[self.start + self.width:self.start + 2 * self.width], strict=True):
            (base, n), (other, m) = _split_name(a.name), _split_name(b.name)
            if base != other or self.stride.get(base) != m - n:
                self.valid = False
                return

    def rename(self, text: str | None, layer: int, to: int) -> str | None:
        """``text`` (a module path, key or parameter name) of layer ``layer`` as layer ``to``'s."""
        if text is None:
            return None
        old, new = f"{self.path}.{layer}", f"{self.path}.{to}"
        if text == old:
            return new
        return new + text[len(old):] if text.startswith(old + ".") else text

    def move(self, op: OpNode, layer: int, to: int, shift: int, base: int) -> OpNode:
        """Operator ``op`` of layer ``layer`` as layer ``to``'s: names, keys and parameters
        renamed, inputs at or after operator ``base`` moved by ``shift`` operators."""
        def source(src: Source) -> Source:
            if src.op is not None and src.op >= base:
                src = dataclasses.replace(src, op=src.op + shift)
            if src.param is not None:
                src = dataclasses.replace(src, param=self.rename(src.param, layer, to))
            return src
        name, number = _split_name(op.name)
        steps = (to - layer) if layer < CAPTURED else 0
        return dataclasses.replace(
            op, name=_join_name(name, number + self.stride.get(name, 0) * steps),
            key=self.rename(op.key, layer, to), module=self.rename(op.module, layer, to) or "",
            sources=tuple(source(s) for s in op.sources))

    def consistent(self) -> bool:
        """Layer 2 is layer 1 moved by one layer, and what follows reads only the last layer."""
        w, ops = self.width, self.ops
        for r in range(w):
            moved = self.move(ops[self.start + w + r], 1, 2, w, self.start)
            if dataclasses.replace(moved, is_output=False) != \
                    dataclasses.replace(ops[self.start + 2 * w + r], is_output=False):
                return False
        return all(not (self.start <= s.op < self.end - w)
                   for op in ops[self.end:] for s in op.sources if s.op is not None)

    def expand(self, layers: int) -> list[OpNode]:
        """The graph with ``layers`` layers (module docstring)."""
        w, ops, extra = self.width, self.ops, (layers - CAPTURED) * self.width
        found = list(ops[:self.start + w])
        for i in range(1, layers):
            template = 1 if i < layers - 1 else 2  # the last layer is layer 2's copy
            for r in range(w):
                op = ops[self.start + template * w + r]
                found.append(self.move(op, template, i, (i - template) * w, self.start))
        for op in ops[self.end:]:
            name, number = _split_name(op.name)
            moved = self.move(op, CAPTURED, CAPTURED, extra, self.start)
            found.append(dataclasses.replace(moved, name=_join_name(
                name, number + self.stride.get(name, 0) * (layers - CAPTURED))))
        return found


@contextlib.contextmanager
def first_layers(stack: nn.ModuleList, count: int) -> Iterator[None]:
    """``stack`` holding only its first ``count`` layers inside (for a capture), whole after."""
    layers = collections.OrderedDict(stack._modules)
    stack._modules = collections.OrderedDict(list(layers.items())[:count])
    try:
        yield
    finally:
        stack._modules = layers


def capture_repeated(model: nn.Module, example_inputs: tuple,
                     capture: Callable[[nn.Module, tuple], list[OpNode]]) -> list[OpNode]:
    """``capture(model, example_inputs)``'s operators, capturing a repeated layer stack's first
    ``CAPTURED`` layers only where that gives the same graph (module docstring)."""
    found = repeated_stack(model)
    if found is None:
        return capture(model, example_inputs)
    path, stack = found
    try:
        with first_layers(stack, CAPTURED):
            ops = capture(model, example_inputs)
    except Exception:  # noqa: BLE001 - a forward that needs every layer: capture them all
        ops = None
    if ops is not None:
        cut = _Layers(ops, path)
        if cut.valid and cut.consistent():
            return cut.expand(len(stack))
    return capture(model, example_inputs)
