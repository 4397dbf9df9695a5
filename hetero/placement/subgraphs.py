"""Higher-order ops in a captured graph: inlined where their semantics allow, else kept whole.

``torch.export`` turns regions such as ``@torch.no_grad()`` (rotary embeddings in the Llama
family) and ``torch.autocast(..., enabled=False)`` into higher-order ops
(``wrap_with_set_grad_enabled``, ``wrap_with_autocast``) whose bodies are nested graph modules
fetched with ``get_attr``. Grad mode and autocast are per-op dispatch state, so such a region is
inlined: each of its ops becomes a ``ModeOp`` that runs the op under the region's mode. Its ops
then take their devices by the ordinary rules (a tagged embedding inside an autocast region still
goes to the host) and a region can span partitions. Any other higher-order op (``cond``,
``invoke_subgraph``, checkpointing, ...) runs as one unit on its node's device, so what is done
to a partition's graph (device arguments pointed at the partition's device, capture-time
assertions dropped) is done to the bodies it calls as well. fx has no pass that walks into these
bodies, hence this module.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx

from foundation import device as hd

_METADATA_ASSERT = torch.ops.aten._assert_tensor_metadata.default


def attr(gm: fx.GraphModule, target: str) -> Any:
    """The attribute a ``get_attr`` node fetches (dotted paths included)."""
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def is_body(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` fetches a nested graph (a higher-order op's body), not a tensor."""
    return node.op == "get_attr" and isinstance(attr(gm, node.target), torch.nn.Module)


def bodies(gm: fx.GraphModule) -> Iterator[tuple[fx.Node, fx.GraphModule]]:
    """Every (get_attr node, nested graph module) of ``gm``'s own graph."""
    for node in gm.graph.nodes:
        if is_body(gm, node) and isinstance(attr(gm, node.target), fx.GraphModule):
            yield node, attr(gm, node.target)


def drop_metadata_asserts(gm: fx.GraphModule) -> None:
    """Remove ``_assert_tensor_metadata`` checks at every level: they pin the devices seen at
    capture (meta), which placement changes on purpose."""
    for node in list(gm.graph.nodes):
        if node.target is _METADATA_ASSERT and not node.users:
            gm.graph.erase_node(node)
    for _, body in bodies(gm):
        drop_metadata_asserts(body)
    gm.recompile()


def _captured_types() -> tuple[str, ...]:
    """Device types a capture records (its fake tensors sit on the accelerator, or the host):
    an autocast region naming one of them meant "where this runs"."""
    return ("meta", hd.resolve("device").type)


def _relocate(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.device):
        return device
    if isinstance(value, (list, tuple)):
        return type(value)(_relocate(v, device) for v in value)
    return value


def relocate(gm: fx.GraphModule, device: torch.device) -> None:
    """Point every device argument of ``gm`` (and of the bodies it calls) at ``device``.

    Capture ran on fake tensors all on one device, so every recorded device argument
    (``arange(device=...)``, ``to(device)``, an autocast region's device type) describes the
    capture, not the run. A body
    is copied before it is changed: one body can serve ops on two partitions.
    """
    for node in gm.graph.nodes:
        node.args = _relocate(node.args, device)
        node.kwargs = {k: _relocate(v, device) for k, v in node.kwargs.items()}
        if isinstance(node.target, ModeOp):
            node.target = node.target.relocated(device)
        elif ("autocast" in str(node.target) and node.args
              and node.args[0] in _captured_types()):
            node.args = (device.type, *node.args[1:])
    for node, body in list(bodies(gm)):
        private = copy.deepcopy(body)
        relocate(private, device)
        owner, _, name = node.target.rpartition(".")
        setattr(attr(gm, owner) if owner else gm, name, private)
    gm.recompile()


def rename_bodies(gm: fx.GraphModule, prefix: str = "body_") -> None:
    """Give top-level bodies names that cannot collide with ``split_module``'s ``submod_<i>``."""
    for i, (node, body) in enumerate(list(bodies(gm))):
        if "." in node.target:
            continue
        name = f"{prefix}{i}"
        setattr(gm, name, body)
        node.target = name
    for name in {n for n, _ in gm.named_children() if n.startswith("submod_")}:
        if not any(n.op == "get_attr" and n.target == name for n in gm.graph.nodes):
            delattr(gm, name)
    gm.recompile()


class ModeOp:
    """``op`` run under the grad mode or autocast state of the region it was captured in."""

    def __init__(self, op: Callable[..., Any], grad: bool | None = None,
                 autocast: tuple | None = None) -> None:
        self.op, self.grad, self.autocast = op, grad, autocast
        self.__name__ = f"{'no_grad' if grad is False else 'grad' if grad else 'autocast'}_" \
                        f"{getattr(op, '__name__', 'op')}".replace(".", "_")
        self.__module__ = __name__

    def relocated(self, device: torch.device) -> ModeOp:
        op = self.op.relocated(device) if isinstance(self.op, ModeOp) else self.op
        autocast = self.autocast
        if autocast is not None and autocast[0] in _captured_types():
            autocast = (device.type, *autocast[1:])
        return ModeOp(op, self.grad, autocast)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.autocast is not None:
            device_type, dtype, enabled, cache = self.autocast
            with torch.autocast(device_type, dtype, enabled, cache):
                return self.op(*args, **kwargs)
        if self.grad is None or self.grad == torch.is_grad_enabled():
            return self.op(*args, **kwargs)
        previous = torch.is_grad_enabled()
        torch.set_grad_enabled(self.grad)  # as a call it switches at once: no context object
        try:
            return self.op(*args, **kwargs)
        finally:
            torch.set_grad_enabled(previous)

    def __repr__(self) -> str:
        return f"ModeOp({self.op}, grad={self.grad}, autocast={self.autocast})"


def _region(node: fx.Node) -> tuple[fx.Node, tuple, dict] | None:
    """(body node, body args, ModeOp keywords) for a grad-mode or autocast region, else None."""
    name = getattr(node.target, "__name__", str(node.target))
    if node.op != "call_function" or name not in ("wrap_with_set_grad_enabled",
                                                  "wrap_with_autocast"):
        return None
    if any(u.target is not operator.getitem for u in node.users):
        return None  # used whole: keep it as one unit
    if name == "wrap_with_set_grad_enabled":
        return node.args[1], node.args[2:], {"grad": bool(node.args[0])}
    return node.args[4], node.args[5:], {"autocast": tuple(node.args[:4])}


def inline_mode_regions(gm: fx.GraphModule) -> None:
    """Inline every grad-mode and autocast region of ``gm`` (innermost first), see module doc."""
    for node in list(gm.graph.nodes):
        region = _region(node)
        if region is None:
            continue
        body_node, body_args, mode = region
        body = attr(gm, body_node.target)
        inline_mode_regions(body)
        if any(is_body(body, n) for n in body.graph.nodes):
            continue  # it calls another kind of higher-order op: keep the region whole
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        env = dict(zip(placeholders, body_args, strict=True))
        with gm.graph.inserting_before(node):
            for inner in body.graph.nodes:
                if inner.op in ("placeholder", "output"):
                    continue
                copied = gm.graph.node_copy(inner, env.__getitem__)
                if copied.op == "call_function":
                    copied.target = ModeOp(copied.target, **mode)
                env[inner] = copied
        output = next(n for n in body.graph.nodes if n.op == "output")
        results = fx.node.map_arg(output.args[0], env.__getitem__)
        for user in list(node.users):
            user.replace_all_uses_with(results[user.args[1]])
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        if not body_node.users:
            gm.graph.erase_node(body_node)
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()


def op_schema(node: fx.Node) -> Any:
    """The aten schema of a call node's op (looking through ``ModeOp``), or None."""
    if node.op != "call_function":
        return None
    target = node.target
    while isinstance(target, ModeOp):
        target = target.op
    return getattr(target, "_schema", None)
