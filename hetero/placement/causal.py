"""Give a captured graph back the causal attention that eager runs: SDPA's ``is_causal``.

Eager HuggingFace decoders (Llama, Qwen2, Mistral, ...) call ``scaled_dot_product_attention``
with ``attn_mask=None, is_causal=True`` and, for grouped-query attention, ``enable_gqa=True``.
Under ``torch.export`` transformers cannot skip the mask (it is tracing), so the captured graph
builds the boolean causal mask from ``arange``s every call (with its packed-sequence check:
``diff``/``cumsum``/``index``/``eq``), repeats the key/value heads (``repeat_kv``: unsqueeze,
expand, reshape, whose backward is an extra reduction) and runs SDPA with that mask: a slower
kernel path than eager's, forward and backward, and dozens of extra ops. That is most of what a
placed Llama costs over the unplaced one.

This pass undoes it where it is provably the same computation. A mask qualifies when its whole
construction depends on no graph input, parameter or buffer: only ops with literal arguments,
none random or mutating. Such a mask is a constant of the capture (a capture is specialised to
its input shapes, ``cache.py``; a new length is a new capture, proved again), so evaluating its
subgraph once here yields exactly what every call would compute. When that value is the
top-left lower-triangular ``L x S`` mask that ``is_causal=True`` means (broadcast over batch and
heads), the call becomes ``is_causal=True`` without a mask. A mask that reads an input (a padding
``attention_mask``) or has any other value is left alone. Then, as eager does without a mask,
keys and values repeated by ``repeat_kv``'s exact shape pattern go in unrepeated with
``enable_gqa=True`` (SDPA's own ``repeat_interleave`` of the heads, the same values).
"""

from __future__ import annotations

import torch
from torch import fx

from hetero.placement import subgraphs

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_ATEN = torch.ops.aten
_MASK, _CAUSAL = 3, 5  # positions of attn_mask and is_causal in SDPA's schema
# Ops whose result is whatever memory held (``empty``, ``new_empty``, ``empty_strided``...): a
# value folded from them once says nothing about the next call.
_UNINITIALISED = ("empty", "new_empty")


def _argument(node: fx.Node, index: int, name: str, default: object) -> object:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _constant_cone(mask: fx.Node) -> list[fx.Node] | None:
    """The nodes ``mask`` is computed from, in graph order, when none is an input, a fetched
    tensor (parameters and buffers change between calls), a random or mutating op or a region
    op; else None."""
    cone: dict[fx.Node, None] = {}
    stack = [mask]
    while stack:
        node = stack.pop()
        if node in cone:
            continue
        schema = subgraphs.op_schema(node)
        tags = getattr(node.target, "tags", None)  # an aten op's; a region op (ModeOp) has none
        if (schema is None or tags is None or schema.is_mutable
                or torch.Tag.nondeterministic_seeded in tags
                or schema.name.split("::")[-1].startswith(_UNINITIALISED)):
            return None
        cone[node] = None
        stack.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(cone, key=order.__getitem__)


def _evaluate(cone: list[fx.Node]) -> object:
    """Run the constant subgraph ``cone`` (what the graph would compute on any call); None when
    an op of it cannot run here and now (the mask then stays: the rewrite is only a speed-up)."""
    env: dict[fx.Node, object] = {}
    try:
        with torch.no_grad():
            for node in cone:
                args = fx.node.map_arg(node.args, env.__getitem__)
                kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
                env[node] = node.target(*args, **kwargs)
    except Exception:
        return None
    return env[cone[-1]]


def _is_causal_mask(value: object, query: fx.Node, key: fx.Node) -> bool:
    """Whether ``value`` is the boolean mask SDPA's ``is_causal=True`` means for this call:
    ``ones(L, S).tril()``, the same for every batch row and head."""
    q, k = query.meta.get("val"), key.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.dtype != torch.bool or q is None or k is None:
        return False
    length, source = q.shape[-2], k.shape[-2]
    if value.dim() < 2 or tuple(value.shape[-2:]) != (length, source):
        return False
    causal = torch.ones(length, source, dtype=torch.bool, device=value.device).tril()
    return torch.equal(value, causal.expand(value.shape))


def _repeated_heads(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(x, n) when ``node`` is ``repeat_kv(x, n)``: ``x[:, :, None].expand(B, H, n, S, D)
    .reshape(B, H * n, S, D)``, which is ``x.repeat_interleave(n, dim=1)``; else None."""
    if node.op != "call_function" or node.target not in (_ATEN.reshape.default,
                                                         _ATEN.view.default):
        return None
    expand = node.args[0]
    if not isinstance(expand, fx.Node) or expand.target is not _ATEN.expand.default:
        return None
    unsqueeze = expand.args[0]
    if (not isinstance(unsqueeze, fx.Node) or unsqueeze.target is not _ATEN.unsqueeze.default
            or unsqueeze.args[1] != 2):
        return None
    source = unsqueeze.args[0]
    x, wide, out = (n.meta.get("val") for n in (source, expand, node))
    if x is None or wide is None or out is None or x.dim() != 4:
        return None
    b, h, s, d = x.shape
    n = wide.shape[2]
    if tuple(wide.shape) != (b, h, n, s, d) or tuple(out.shape) != (b, h * n, s, d):
        return None
    return source, n


def _ungroup(node: fx.Node) -> None:
    """Hand SDPA the unrepeated keys and values with ``enable_gqa=True`` (eager's call)."""
    key, value = node.args[1], node.args[2]
    if node.kwargs.get("enable_gqa", False):
        return
    repeated = [_repeated_heads(a) if isinstance(a, fx.Node) else None for a in (key, value)]
    if None in repeated or repeated[0][1] != repeated[1][1]:
        return
    node.args = (node.args[0], repeated[0][0], repeated[1][0], *node.args[3:])
    node.kwargs = {**node.kwargs, "enable_gqa": True}


def _repeat_nodes(node: object) -> list[fx.Node]:
    """The unsqueeze, expand and reshape of a ``repeat_kv`` (for erasing once unused)."""
    if not isinstance(node, fx.Node) or _repeated_heads(node) is None:
        return []
    return [node.args[0].args[0], node.args[0], node]


def _erase_unused(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase those of ``nodes`` nothing reads any more, users before what they read."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted(set(nodes), key=order.__getitem__, reverse=True):
        if not node.users:
            graph.erase_node(node)


def restore_causal_attention(gm: fx.GraphModule) -> int:
    """Rewrite every SDPA call of ``gm`` whose mask is provably the causal one to
    ``is_causal=True`` (see the module docstring); return how many were rewritten."""
    rewritten, dead = 0, []
    values: dict[fx.Node, object] = {}  # per mask node: the layers share one mask
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        mask = _argument(node, _MASK, "attn_mask", None)
        if not isinstance(mask, fx.Node) or _argument(node, _CAUSAL, "is_causal", False):
            continue
        cone = _constant_cone(mask)
        if cone is None:
            continue
        if mask not in values:
            values[mask] = _evaluate(cone)
        if not _is_causal_mask(values[mask], node.args[0], node.args[1]):
            continue
        args, kwargs = list(node.args), dict(node.kwargs)
        if len(args) > _MASK:
            args[_MASK] = None
        kwargs.pop("attn_mask", None)
        if len(args) > _CAUSAL:
            args[_CAUSAL] = True
        else:
            kwargs["is_causal"] = True
        dead += cone + _repeat_nodes(args[1]) + _repeat_nodes(args[2])
        node.args, node.kwargs = tuple(args), kwargs
        _ungroup(node)
        rewritten += 1
    if rewritten:
        _erase_unused(gm.graph, dead)
        gm.recompile()
    return rewritten
