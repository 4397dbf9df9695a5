"""In-place writes across partitions: every write lands on the real tensor, in eager order.

The captured graph (export's training IR) keeps in-place ops: HuggingFace's
``shift_tokens_right`` is ``shifted = new_zeros(...); slice(shifted)[...].copy_(ids)``. The write
nodes have no users, so data edges alone neither keep them on the tensor's device nor order them
before the tensor's readers: split naively, a write could update a copy, or race with a reader
on the other device. This pass restores eager semantics in two steps:

1. Alias classes: every node is mapped to the base tensor it aliases (views and in-place ops
   return an alias of an argument, per the op schema's alias annotations). A class with a write
   keeps its views and writes on the base's device, so they act on the one real storage; an
   op/scope tag that explicitly asks for another device is refused by name.
2. Order edges: within such a class, an access after a write waits for the write, and a write
   waits for every earlier access (a reader on another device copies the tensor when its
   partition starts). The levels that form partitions and the runner both honour these edges,
   so no partition reads a tensor before, or while, it is written.

torch's functionalization would remove the mutations instead, but it also rewrites every view
into a copy; the placed graph should keep the model's own memory behaviour.
"""

from __future__ import annotations

import dataclasses
import operator

from torch import fx

from hetero.placement.assign import Assignment
from hetero.placement.subgraphs import op_schema
from hetero.tags import ANNOTATION_KEY


@dataclasses.dataclass
class Mutations:
    """Extra ordering per node (nodes that must finish first), the nodes moved to their base
    tensor's device (with that device), and every node of a written alias class (pinned: no
    later pass may move them)."""

    after: dict[fx.Node, set[fx.Node]]
    moved: dict[fx.Node, str]
    pinned: set[fx.Node] = dataclasses.field(default_factory=set)


def _aliases(node: fx.Node) -> tuple[fx.Node | None, bool]:
    """(the argument ``node``'s output aliases, whether ``node`` writes into it)."""
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        parent = op_schema(node.args[0])
        returns_views = parent is not None and any(
            r.alias_info is not None for r in parent.returns)
        return (node.args[0] if returns_views else None), False
    schema = op_schema(node)
    if schema is None:
        return None, False
    out_sets = set().union(*(r.alias_info.before_set for r in schema.returns
                             if r.alias_info is not None)) if schema.returns else set()
    aliased, writes = None, False
    for arg, value in zip(schema.arguments, node.args, strict=False):
        info = arg.alias_info
        if info is None or not isinstance(value, fx.Node):
            continue
        if info.is_write:
            writes = True
            aliased = aliased or value
        elif info.before_set & out_sets:
            aliased = aliased or value
    return aliased, writes


def _base_device(base: fx.Node, a: Assignment, input_device: dict[fx.Node, str | None],
                 default: str) -> str:
    if base in a.node_device:
        return a.node_device[base]
    if base.op == "get_attr":
        return a.tensor_home.get(base.target, default)
    return input_device.get(base) or default


def analyse(gm: fx.GraphModule, a: Assignment, input_devices: list[str | None],
            default: str) -> Mutations:
    """Move each written alias class's views and writes to its base's device (updating
    ``a.node_device``) and return the order edges; raise ValueError for a contradicting tag."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    input_device = dict(zip(placeholders, input_devices, strict=False))
    base: dict[fx.Node, fx.Node] = {}
    members: dict[fx.Node, list[fx.Node]] = {}
    written: set[fx.Node] = set()
    writers: set[fx.Node] = set()
    for node in gm.graph.nodes:
        source, writes = _aliases(node)
        base[node] = base.get(source, source) if source is not None else node
        members.setdefault(base[node], []).append(node)
        if writes:
            written.add(base[node])
            writers.add(node)
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    after: dict[fx.Node, set[fx.Node]] = {}
    moved: dict[fx.Node, str] = {}
    pinned: set[fx.Node] = set()
    for b in written:
        pinned.update(members[b])
        device = _base_device(b, a, input_device, default)
        aliases = set(members[b])
        for node in members[b]:  # the views and writes: on the real storage's device
            if node is b or node not in a.node_device or a.node_device[node] == device:
                continue
            tag = (node.meta.get("custom") or {}).get(ANNOTATION_KEY)
            if tag is not None and tag != device and node in writers:
                raise ValueError(
                    f"'{node.name}' ({node.target}) in module '{a.node_module[node] or '<root>'}' "
                    f"writes in place into '{b.name}', which lives on {device}, but an op/scope "
                    f"tag places it on {tag}: it would update a copy; tag the write like the "
                    f"tensor it updates, or write into a copy explicitly (x = x.clone())")
            a.node_device[node] = moved[node] = device
        accesses = sorted({u for m in aliases for u in m.users if u in a.node_device}
                          | {w for w in writers if w in aliases}, key=position.__getitem__)
        for w in (n for n in accesses if n in writers):
            for other in accesses:
                if other is w:
                    continue
                first, then = (w, other) if position[w] < position[other] else (other, w)
                after.setdefault(then, set()).add(first)
    return Mutations(after, moved, pinned)
