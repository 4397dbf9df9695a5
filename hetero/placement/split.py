"""Split a captured graph into per-device partitions with the copies inserted, and build the plan.

Partitioning: every compute node gets two levels — ``early``, the number of device changes on the
longest path from the inputs to it, and ``late``, the number on the longest path from it to the
outputs — and a partition is the set of nodes with the same (early, late, device). Along an edge
``early`` never falls and ``late`` never rises, and both move strictly when the edge changes
device, so two partitions can never depend on each other both ways: the partitions form a DAG.
The edges are data edges plus the order edges of in-place writes (``mutation.py``), so a write
and the reads it must precede or follow land in partitions the plan orders alike.
The ``late`` level is what buys concurrency: in ``h = f(x); y = cpu_branch(h) + dev_branch(h)``
the device branch gets its own partition instead of joining ``f``'s, so it runs while the host
runs its branch. ``CapabilityBasedPartitioner`` groups one kind of node only and can leave a CPU
group and a device group depending on each other both ways; the levels avoid that. The graph
surgery itself is torch's ``split_module``. Each partition then copies its inputs to its device
(``transfer.to_device``: a no-op for values already there) and creates new tensors on it.
"""

from __future__ import annotations

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module

from foundation import device as hd
from hetero.placement import mutation, subgraphs
from hetero.placement.assign import Assignment, assign
from hetero.placement.capture import Captured
from hetero.placement.plan import Partition, Plan
from hetero.placement.transfer import to_device
from hetero.tags import ANNOTATION_KEY

_ORDER = {"device": 0, "cpu": 1}


def _nbytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(v.numel() * v.element_size() for v in val if isinstance(v, torch.Tensor))
    return 0


_RESHAPES = {"view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "transpose", "permute",
             "t", "flatten", "alias", "detach"}


def _views_follow_readers(gm: fx.GraphModule, a: Assignment, pinned: set[fx.Node]) -> None:
    """A reshaping view read only on another device goes there: the same bytes cross either way,
    and a lone view no longer makes a partition of its own (``ids.view(-1)`` feeding a host
    lookup). Slices stay: copying their base would cost more."""
    for node in reversed(gm.graph.nodes):
        name = getattr(subgraphs.op_schema(node), "name", "").split("::")[-1]
        if (node not in a.node_device or node in pinned or name not in _RESHAPES
                or (node.meta.get("custom") or {}).get(ANNOTATION_KEY)):
            continue
        readers = {a.node_device.get(u) for u in node.users}
        if len(readers) == 1 and None not in readers:
            a.node_device[node] = readers.pop()


def _levels(gm: fx.GraphModule, a: Assignment, after: dict[fx.Node, set[fx.Node]]
            ) -> dict[fx.Node, tuple[int, int, str]]:
    """(early, late, device) per compute node over data and order edges; see the module doc."""
    dev = a.node_device
    before: dict[fx.Node, set[fx.Node]] = {}
    for node, firsts in after.items():
        for first in firsts:
            before.setdefault(first, set()).add(node)
    early: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node in dev:
            preds = [*node.all_input_nodes, *after.get(node, ())]
            early[node] = max((early[i] + (dev[i] != dev[node]) for i in preds if i in dev),
                              default=0)
    late: dict[fx.Node, int] = {}
    for node in reversed(gm.graph.nodes):
        if node in dev:
            succs = [*node.users, *before.get(node, ())]
            late[node] = max((late[u] + (dev[u] != dev[node]) for u in succs if u in dev),
                             default=0)
    return {n: (early[n], late[n], dev[n]) for n in dev}


def _localise(sub: fx.GraphModule, device: torch.device) -> None:
    """Copy every input of ``sub`` to ``device`` and create new tensors there (at every nesting
    level: higher-order ops' bodies included)."""
    graph = sub.graph
    for node in list(graph.nodes):
        if node.op == "placeholder":
            with graph.inserting_after(node):
                moved = graph.call_function(to_device, (node, device))
            node.replace_all_uses_with(moved, delete_user_cb=lambda user, m=moved: user is not m)
            moved.meta = dict(node.meta)
    subgraphs.relocate(sub, device)


def _home_constants(gm: fx.GraphModule, a: Assignment, part_of: dict[fx.Node, int],
                    devices: dict[int, str]) -> None:
    """Move tensors that export lifted out of forward to the device of their first reader."""
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in a.constants:
            readers = [part_of[u] for u in node.users if u in part_of]
            if readers:
                owner, _, name = node.target.rpartition(".")
                holder = subgraphs.attr(gm, owner) if owner else gm
                value = getattr(holder, name)
                setattr(holder, name, value.to(hd.resolve(devices[min(readers)])))


def _plan(gm: fx.GraphModule, a: Assignment, part_of: dict[fx.Node, int],
          devices: dict[int, str], input_devices: list[str | None],
          after: dict[fx.Node, set[fx.Node]]) -> list[Partition]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    input_dev = dict(zip(placeholders, input_devices, strict=False))
    parts = {i: Partition(i, f"submod_{i}", d, hd.resolve(d), [], [], 0, 0, 0, [])
             for i, d in devices.items()}
    counted: set[str] = set()  # each parameter's bytes count once, in its first partition
    seen: dict[int, set[fx.Node]] = {i: set() for i in parts}
    for node in gm.graph.nodes:
        if node not in part_of:
            continue
        p = parts[part_of[node]]
        p.nodes.append(node.name)
        for first in after.get(node, ()):  # ordered after an in-place write (or before one)
            if part_of[first] != p.index and part_of[first] not in p.depends_on:
                p.depends_on.append(part_of[first])
        module = a.node_module[node]
        if module not in p.modules:
            p.modules.append(module)
        for inp in node.all_input_nodes:
            if inp in seen[p.index] or part_of.get(inp) == p.index:
                continue
            seen[p.index].add(inp)
            if inp in part_of:
                if part_of[inp] not in p.depends_on:
                    p.depends_on.append(part_of[inp])
                crossing = devices[part_of[inp]] != p.device
            elif inp.op == "get_attr" and inp.target not in a.tensor_home:
                crossing = False  # a body (runs with its op) or a constant homed with its reader
            elif inp.op == "get_attr":
                crossing = a.tensor_home[inp.target] != p.device
                if not crossing and inp.target not in counted:
                    counted.add(inp.target)
                    p.param_bytes += _nbytes(inp)
            else:
                crossing = input_dev.get(inp) not in (None, p.device)
            if crossing:
                p.copies_in.append(inp.name)
                p.bytes_in += _nbytes(inp)
        if any(u in part_of and devices[part_of[u]] != p.device for u in node.users):
            p.bytes_out += _nbytes(node)
    return [parts[i] for i in sorted(parts)]


def split(captured: Captured, model: nn.Module, default: str, overrides: dict[nn.Module, str],
          input_devices: list[str | None], ops_only: dict[str, str] | None = None,
          ) -> tuple[fx.GraphModule, Plan]:
    """Partition ``captured`` by device; return the split module (submodules ``submod_<i>``,
    already copying their inputs) and the plan. Moves no parameter (see ``apply_homes``)."""
    gm = captured.graph_module
    a = assign(gm, model, default, overrides, ops_only)
    writes = mutation.analyse(gm, a, input_devices, default)
    _views_follow_readers(gm, a, writes.pinned)
    level = _levels(gm, a, writes.after)
    # Sorted by rising early and falling late level: a topological order of the partitions.
    keys = sorted(set(level.values()), key=lambda k: (k[0], -k[1], _ORDER[k[2]]))
    index = {key: i for i, key in enumerate(keys)}
    part_of = {n: index[level[n]] for n in level}
    devices = {index[k]: k[2] for k in keys}
    _home_constants(gm, a, part_of, devices)
    split_gm = split_module(gm, gm, lambda n: part_of[n])
    for i, dev in devices.items():
        _localise(getattr(split_gm, f"submod_{i}"), hd.resolve(dev))
    plan = Plan(_plan(gm, a, part_of, devices, input_devices, writes.after), a.tensor_home,
                notes=list(a.notes))
    if writes.moved:
        plan.notes.append(
            f"in-place writes kept on their tensor's device: "
            f"{', '.join(sorted(f'{n.name} ({d})' for n, d in writes.moved.items()))}")
    return split_gm, plan


def apply_homes(model: nn.Module, tensor_home: dict[str, str]) -> None:
    """Move each parameter and buffer to its home device, in place (same tensor objects, so every
    captured graph, the optimizer and ``state_dict`` keep seeing them)."""
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    for name, home in tensor_home.items():
        tensor, target = tensors[name], hd.resolve(home)
        if tensor.device != target:
            tensor.data = tensor.data.to(target)
