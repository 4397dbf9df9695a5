"""The graph automatic parallel plans over: a model's operators that have a sharding rule.

The model is captured with ``torch.export`` on fake twins of its tensors (the capture
``hetero.place`` uses): no memory is spent and no process group is needed. Every ATen node
whose operator has a semi-auto rule (linear, matmul, elementwise, layer norm, softmax,
embedding, attention) becomes an :class:`OpNode` with its input shapes; each tensor input is
traced back through layout-preserving nodes (clone, dropout, dtype casts) to the rule operator
that produced it, a parameter, a model input, or an *opaque* node (a view or permute whose
layout mapping the planner does not follow: the producer then keeps that output split along
the batch dimension only).

An operator is applicable when semi-auto can take its strategy: the node of a module with a
module rule (``nn.Linear`` at ``blocks.0.mlp.0``: keyed by the module path), or of a
``parallel.shard`` operator held as a module attribute (keyed ``path.attribute``). Other rule
operators are planned too (they carry the layouts between applicable ones) and DTensor runs
them with the layouts they receive.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import fx, nn

from hetero.placement.capture import capture
from parallel.semi_auto.registry import module_rule
from parallel.semi_auto.rules import (
    BINARY,
    BMM,
    EMBEDDING,
    LAYER_NORM,
    LINEAR,
    MATMUL,
    MM,
    SDPA,
    SOFTMAX,
    UNARY,
    OpRule,
)
from parallel.semi_auto.shard import PLANNING, SHARDED_OP_KEY, module_tag
from parallel.semi_auto.trace import sharded_ops

ATEN_RULES: dict[str, OpRule] = {
    "linear": LINEAR, "matmul": MATMUL, "mm": MM, "bmm": BMM, "layer_norm": LAYER_NORM,
    "softmax": SOFTMAX, "_softmax": SOFTMAX, "embedding": EMBEDDING,
    "scaled_dot_product_attention": SDPA,
    **dict.fromkeys(["add", "sub", "mul", "div"], BINARY),
    **dict.fromkeys(["relu", "gelu", "tanh", "sigmoid", "silu"], UNARY),
}
#: nodes whose output has its input's layout
TRANSPARENT = {"clone", "contiguous", "alias", "dropout", "detach", "_to_copy", "to",
               "type_as", "lift_fresh_copy"}


@dataclasses.dataclass
class Source:
    """Where an operator input comes from: ``kind`` is "op" (``op`` indexes the graph's ops),
    "param", "input" or "opaque" (``op``: the rule operator behind the view, if any)."""

    kind: str
    op: int | None = None
    param: str | None = None  # the parameter's name, for "param"

    @property
    def linked(self) -> bool:
        """Fed by a planned operator, directly or behind a view: an edge the plan prices."""
        return self.kind in ("op", "opaque") and self.op is not None


@dataclasses.dataclass
class OpNode:
    """One rule operator of the captured graph."""

    name: str  # the fx node's name
    key: str | None  # where semi-auto takes its strategy; None: DTensor runs it
    rule: OpRule
    info: dict[str, Any]
    shapes: tuple[tuple[int, ...], ...]  # per present tensor input, in rule order
    sources: tuple[Source, ...]
    out_shape: tuple[int, ...]
    itemsize: int
    annotated: Any = None  # the user's in_strategy, when one was given
    module: str = ""  # the innermost module running it ("": the root's own forward)
    is_output: bool = False  # its result leaves the graph (made whole there)
    target: str = ""  # the ATen operator ("gelu", "add", "layer_norm"): a profile's rate key


def subgraph(ops: list[OpNode], keep: list[int]) -> list[OpNode]:
    """The operators ``keep`` (indices, in order) as a graph of their own: an input another
    operator produced becomes a model input (a pipeline stage receives it whole)."""
    new = {j: i for i, j in enumerate(keep)}
    crossing = {src.op for j, op in enumerate(ops) if j not in new
                for src in op.sources if src.op is not None}  # sent to a later stage whole

    def source(src: Source) -> Source:
        if src.kind == "op":
            return Source("op", new[src.op]) if src.op in new else Source("input")
        if src.kind == "opaque":
            return Source("opaque", new.get(src.op))
        return src
    return [dataclasses.replace(ops[j], sources=tuple(source(s) for s in ops[j].sources),
                                is_output=ops[j].is_output or j in crossing) for j in keep]


def _packet(node: fx.Node) -> str | None:
    target = node.target
    packet = getattr(target, "_overloadpacket", None)
    return getattr(packet, "__name__", None) if packet is not None else None


def _module_of(node: fx.Node, modules: dict[str, nn.Module], rule: OpRule) -> str | None:
    """The innermost module on ``node``'s stack whose module rule is ``rule``."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in reversed(list(stack.values())):
        module = modules.get(path)
        found = module_rule(module) if module is not None else None
        if found is not None and found.rule is rule:
            return path
    return None


def _args(node: fx.Node, packet: str) -> tuple[tuple, dict]:
    if packet == "embedding":  # aten.embedding(weight, indices): F.embedding's order is reversed
        return (node.args[1], node.args[0], *node.args[2:]), dict(node.kwargs)
    return tuple(node.args), dict(node.kwargs)


def capture_ops(model: nn.Module, example_inputs: tuple, reuse: bool = True) -> list[OpNode]:
    """The rule operators of ``model(*example_inputs)`` in execution order. ``reuse``: a stack
    of alike layers is captured three layers deep and the rest copied (``repeated.py``: the
    same graph, without the capture time of every layer)."""
    if reuse:
        from parallel.auto.repeated import capture_repeated

        return capture_repeated(model, example_inputs, _capture_all)
    return _capture_all(model, example_inputs)


def _capture_all(model: nn.Module, example_inputs: tuple) -> list[OpNode]:
    token = PLANNING.set(True)
    try:
        gm = capture(model, example_inputs, {}).graph_module
    finally:
        PLANNING.reset(token)
    modules = dict(model.named_modules())
    sharded = {op.serial: (path, op) for path, op in sharded_ops(model)}
    params = {n for n in gm.graph.nodes if n.op == "get_attr"}
    index: dict[fx.Node, int] = {}
    ops: list[OpNode] = []

    def source(value: fx.Node) -> Source:
        while value.op == "call_function" and _packet(value) in TRANSPARENT:
            value = value.args[0]
        if value in index:
            return Source("op", index[value])
        if value in params:
            return Source("param", param=str(value.target))
        if value.op == "placeholder":
            return Source("input")
        upstream = value  # behind a view or permute: the rule operator feeding it, if any
        while upstream not in index and upstream.op == "call_function" and upstream.args \
                and isinstance(upstream.args[0], fx.Node):
            upstream = upstream.args[0]
        return Source("opaque", index.get(upstream))

    for node in gm.graph.nodes:
        packet = _packet(node) if node.op == "call_function" else None
        rule = ATEN_RULES.get(packet) if packet else None
        value = node.meta.get("val")
        if rule is None or not isinstance(value, torch.Tensor):
            continue
        args, kwargs = _args(node, packet)
        try:
            info = rule.info(args, kwargs)
        except ValueError:
            continue  # a call the rule cannot shard (attention with a mask): left to DTensor
        tensors = [t for t in rule.bind(args, kwargs) if t is not None]
        if not all(isinstance(t, fx.Node) and isinstance(t.meta.get("val"), torch.Tensor)
                   for t in tensors):
            continue
        custom = node.meta.get("custom") or {}
        key, annotated = None, None
        if custom.get(SHARDED_OP_KEY) in sharded:
            key, op = sharded[custom[SHARDED_OP_KEY]]
            annotated = op.in_strategy
        else:
            key = _module_of(node, modules, rule)
            tag = module_tag(modules[key]) if key is not None else None
            annotated = tag.in_strategy if tag is not None else None
        index[node] = len(ops)
        stack = list((node.meta.get("nn_module_stack") or {}).values())
        ops.append(OpNode(
            name=node.name, key=key, rule=rule, info=info,
            shapes=tuple(tuple(t.meta["val"].shape) for t in tensors),
            sources=tuple(source(t) for t in tensors), out_shape=tuple(value.shape),
            itemsize=value.element_size(), annotated=annotated,
            module=stack[-1][0] if stack else "", target=packet.lstrip("_")))
    for node in gm.graph.find_nodes(op="output"):  # results the model returns are made whole
        for value in node.all_input_nodes:
            found = source(value)
            if found.kind in ("op", "opaque") and found.op is not None:
                ops[found.op].is_output = True
    return ops
