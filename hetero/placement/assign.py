"""Decide where each node of a captured graph runs, and where each parameter and buffer lives.

Rules, most specific first:
1. an op or scope tag (``set_device(torch.matmul, ...)``, ``device_scope``) recorded on the node;
2. the innermost tagged module in the node's ``nn_module_stack``;
3. the default device.
Parameters and buffers live where their owning module's innermost tag says (same rules 2–3);
a tensor shared by several modules lives where an explicit tag puts it.
Devices here are logical: "cpu" or "device".
"""

from __future__ import annotations

import dataclasses

from torch import fx, nn

from hetero.placement.subgraphs import attr
from hetero.tags import ANNOTATION_KEY, module_tag, set_device_tag

COMPUTE_OPS = ("call_function", "call_method", "call_module")


@dataclasses.dataclass
class Assignment:
    """Logical device per compute node and per parameter/buffer name, plus each node's module."""

    node_device: dict[fx.Node, str]
    tensor_home: dict[str, str]
    node_module: dict[fx.Node, str]
    constants: set[str] = dataclasses.field(default_factory=set)
    notes: list[str] = dataclasses.field(default_factory=list)


class _TagIndex:
    """Module path → its effective device (innermost tagged ancestor, else the default).
    ``set_device_only``: only ``set_device`` tags count, not a placement a module declares for
    itself, and modules that honour their own tag (``places_itself``) are left out."""

    def __init__(self, model: nn.Module, default: str, overrides: dict[nn.Module, str],
                 ops_only: dict[str, str] | None = None, set_device_only: bool = False) -> None:
        self.default = default
        self.own: dict[str, str] = {}
        # Tags for a module's own ops only (not its children's, not its tensors): how auto_place
        # moves the ops a model runs in its own forward (the loss) without moving the rest.
        self.ops_only = dict(ops_only or {})
        for path, module in model.named_modules(remove_duplicate=False):
            if set_device_only:
                tag = (None if getattr(module, "places_itself", False)
                       else set_device_tag(module))
            else:
                tag = overrides.get(module) or module_tag(module)
            if tag is not None:
                self.own[path] = tag

    def effective(self, path: str) -> str:
        return self.source(path)[0]

    def for_op(self, path: str) -> str:
        """Device of an op whose innermost module is ``path``."""
        return self.ops_only.get(path) or self.effective(path)

    def source(self, path: str) -> tuple[str, str | None]:
        """(device, path of the tagged module it comes from, or None for the default)."""
        while True:
            if path in self.own:
                return self.own[path], path
            if not path:
                return self.default, None
            path = path.rpartition(".")[0]


def tensor_homes(model: nn.Module, tags: _TagIndex) -> dict[str, str]:
    """Home device of every parameter and buffer, by each of its names.

    A tensor registered under several names (tied embedding and output head) has one home: the
    device an explicit tag gives one of its owners, else the default. Two owners tagged for two
    different devices is a contradiction, refused by name.
    """
    aliases: dict[int, list[str]] = {}
    tensors = [*model.named_parameters(remove_duplicate=False),
               *model.named_buffers(remove_duplicate=False)]
    for name, tensor in tensors:
        aliases.setdefault(id(tensor), []).append(name)
    homes: dict[str, str] = {}
    for names in aliases.values():
        tagged: dict[str, str] = {}
        for name in names:
            dev, tagged_by = tags.source(name.rpartition(".")[0])
            if tagged_by is not None:
                tagged.setdefault(dev, (name, tagged_by))
        if len(tagged) > 1:
            (d1, (n1, m1)), (d2, (n2, m2)) = sorted(tagged.items())
            raise ValueError(
                f"'{n1}' and '{n2}' are one shared tensor, but module '{m1 or '<root>'}' places "
                f"it on {d1} and module '{m2 or '<root>'}' on {d2}; tag them alike"
            )
        home = next(iter(tagged)) if tagged else tags.default
        homes.update(dict.fromkeys(names, home))
    return homes


def module_placement(model: nn.Module, default: str = "device"
                     ) -> tuple[dict[str, str], dict[str, str]]:
    """Placement by whole modules from ``set_device`` tags alone (rules 2–3; op and scope tags,
    declared placements and modules that place themselves aside): every module path's device
    and every parameter and buffer name's home (shared tensors as ``tensor_homes`` decides).
    What ``parallel``'s semi-auto mode places a tagged model by (``parallel.semi_auto.host``)."""
    tags = _TagIndex(model, default, {}, set_device_only=True)
    devices = {path: tags.effective(path)
               for path, _ in model.named_modules(remove_duplicate=False)}
    return devices, tensor_homes(model, tags)


def _innermost_module(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path if isinstance(path, str) else ""


def _module_paths(node: fx.Node) -> list[str]:
    return [v[0] for v in (node.meta.get("nn_module_stack") or {}).values()
            if isinstance(v[0], str)]


def follow_idle_tags(gm: fx.GraphModule, model: nn.Module, tags: _TagIndex) -> list[str]:
    """Give an idle tag to the modules that do the tagged module's work; say what happened.

    T5 and Bart keep their table in ``shared`` (what ``get_input_embeddings()`` returns) but
    look it up through ``encoder.embed_tokens`` and ``decoder.embed_tokens``, other modules of
    the same type holding the same weight; ``shared`` itself never runs. A tagged module that ran
    no operation passes its tag to untagged modules of its type that hold all its parameters (a
    tied output head is another type and keeps its own device); if there are none, the returned
    note says the tag did nothing.
    """
    used = {p for node in gm.graph.nodes for p in _module_paths(node)}
    modules = dict(model.named_modules(remove_duplicate=False))
    notes = []
    for path, device in list(tags.own.items()):
        if not path or path in used:
            continue
        owner = modules[path]
        own = {id(p) for p in owner.parameters()}
        followers = [other for other, module in modules.items()
                     if other not in tags.own and type(module) is type(owner) and own
                     and own <= {id(p) for p in module.parameters()}]
        for other in followers:
            tags.own[other] = device
        if followers:
            notes.append(f"'{path}' is tagged {device} but ran no operation; "
                         f"{', '.join(repr(f) for f in followers)} share its weights and follow "
                         f"its tag")
        else:
            notes.append(f"warning: '{path}' is tagged {device} but ran no operation in this "
                         f"capture: the tag places its tensors only")
    return notes


def assign(
    gm: fx.GraphModule, model: nn.Module, default: str, overrides: dict[nn.Module, str],
    ops_only: dict[str, str] | None = None,
) -> Assignment:
    """Apply the rules above to every node of ``gm`` (captured from ``model``)."""
    tags = _TagIndex(model, default, overrides, ops_only)
    notes = follow_idle_tags(gm, model, tags)
    node_device: dict[fx.Node, str] = {}
    node_module: dict[fx.Node, str] = {}
    homes = tensor_homes(model, tags)
    tensor_home: dict[str, str] = {}
    constants: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            if isinstance(attr(gm, node.target), nn.Module):
                continue  # a higher-order op's body: it runs with (and where) its op runs
            if node.target in homes:
                tensor_home[node.target] = homes[node.target]
            else:  # a tensor made in forward, lifted by export: it goes where it is read
                constants.add(node.target)
        elif node.op in COMPUTE_OPS:
            path = _innermost_module(node)
            node_module[node] = path
            annotated = (node.meta.get("custom") or {}).get(ANNOTATION_KEY)
            node_device[node] = annotated or tags.for_op(path)
    return Assignment(node_device, tensor_home, node_module, constants, notes)
