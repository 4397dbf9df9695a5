"""Read a decoder's :class:`TransformerShape` from its captured graph, not from its names.

The model is captured on fake tensors (``hetero.placement.capture``: no memory, a meta-device
model of any size) with its stack of alike layers (``parallel.auto.repeated.repeated_stack``:
found by structure, whatever it is called) cut to one layer, which is what makes a 70-layer model
read as fast as a 1-layer one (a forward that needs every layer is captured whole); the sizes are
the operators' own:

* **layers, heads, key/value heads**: the stack's length times the layer's attention calls
  (``scaled_dot_product_attention``, with or without a mask, or a backend's fused variant); the
  query is ``[b, heads, seq, head_dim]``, the key ``[b, kv_heads, seq, head_dim]``;
* **vocabulary, hidden width**: the embedding that reads the model's input ids,
  ``[vocab, hidden]``;
* **MLP width and kind**: the projections back to the hidden width from a wider one (``down``,
  ``fc2``, ``c_proj``: whatever they are called) give the width; a gated MLP (SwiGLU) has two
  projections up to it per projection down (or one fused to twice the width), a GELU MLP one;
* **tied head**: the last projection to the vocabulary reads the embedding's own table;
* **experts** (a mixture of experts): the stacked expert weights, ``[experts, hidden, width]``
  parameters (either way round), give the experts and their MLP width (gated when one of them is
  twice the other); each MoE layer's ``topk`` over the router's scores gives ``top_k`` and
  counts the MoE layers.

A part the graph does not show is refused naming it (no attention call, no embedding of the input
ids, no MLP), so a model this cannot read is never priced as something else.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch
from torch import fx, nn

from hetero.placement.capture import capture
from parallel.auto.repeated import first_layers, repeated_stack
from parallel.auto.transformer_shape import TransformerShape


@contextlib.contextmanager
def _one_layer(model: nn.Module) -> Iterator[int]:
    """The model with its repeated stack cut to its first layer; yields the stack's length (1
    when it has none: every layer is then captured)."""
    found = repeated_stack(model)
    if found is None:
        yield 1
        return
    stack = found[1]
    length = len(stack)
    with first_layers(stack, 1):
        yield length


@contextlib.contextmanager
def _without_cache(model: nn.Module) -> Iterator[None]:
    """A HuggingFace model captured for training: without its key/value cache (an output type
    the capture cannot hold)."""
    config = getattr(model, "config", None)
    cached = getattr(config, "use_cache", None)
    if cached:
        config.use_cache = False  # type: ignore[union-attr]
    try:
        yield
    finally:
        if cached:
            config.use_cache = cached  # type: ignore[union-attr]


def _name(node: fx.Node) -> str:
    packet = getattr(node.target, "_overloadpacket", None)
    return getattr(packet, "__name__", "") if node.op == "call_function" else ""


def _shape(node: object) -> tuple[int, ...]:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(value.shape) if isinstance(value, torch.Tensor) else ()


def _param(node: object) -> str | None:
    """The parameter ``node`` reads (through a transpose), or None."""
    while isinstance(node, fx.Node) and _name(node) in ("t", "transpose", "permute"):
        node = node.args[0]
    return str(node.target) if isinstance(node, fx.Node) and node.op == "get_attr" else None


def _reads_input(node: object) -> bool:
    """Whether ``node`` is a model input, seen through reshapes (GPT-2 views its ids flat)."""
    while isinstance(node, fx.Node) and _name(node) in _RESHAPES:
        node = node.args[0]
    return isinstance(node, fx.Node) and node.op == "placeholder"


_RESHAPES = ("view", "reshape", "_unsafe_view", "clone", "contiguous", "alias", "_to_copy",
             "expand", "unsqueeze", "squeeze")


def _projections(graph: fx.Graph) -> list[tuple[int, int, str]]:
    """``(in, out, weight name)`` of every matrix product whose weight is a parameter."""
    found = []
    for node in graph.nodes:
        name = _name(node)
        if name == "linear" and _param(node.args[1]):  # weight [out, in]
            out, inp = _shape(node.args[1])[-2:]
            found.append((inp, out, _param(node.args[1]) or ""))
        elif name in ("addmm", "mm", "matmul") and _param(node.args[-1]):  # weight [in, out]
            weight = node.args[-1]
            shape = _shape(weight)
            inp, out = shape[-2:] if _name(weight) not in ("t", "transpose") else shape[::-1][-2:]
            found.append((inp, out, _param(weight) or ""))
    return found


def _refuse(model: nn.Module, missing: str) -> ValueError:
    return ValueError(
        f"plan_cluster cannot read the sizes of {type(model).__name__}: its captured graph has "
        f"{missing}; pass shape=TransformerShape(layers=..., hidden=..., heads=..., seq=..., "
        f"vocab=..., ffn=..., kv_heads=..., gated=..., tied=...)")


def read_decoder(model: nn.Module, example_inputs: tuple) -> TransformerShape:
    """The sizes of ``model`` (see the module docstring), for ``example_inputs[0]`` token ids."""
    with _without_cache(model):
        try:
            with _one_layer(model) as repeats:
                graph = capture(model, example_inputs, {}).graph_module.graph
        except Exception:  # noqa: BLE001  a forward that needs every layer: capture them all
            repeats = 1
            try:
                graph = capture(model, example_inputs, {}).graph_module.graph
            except Exception as err:  # noqa: BLE001  a model this cannot read, whatever failed
                raise _refuse(model, f"no graph at all (the capture failed: {err})") from err
    attention = [n for n in graph.nodes if "scaled_dot_product" in _name(n)
                 and not _name(n).endswith("backward")]
    if not attention:
        raise _refuse(model, "no scaled_dot_product_attention call (one per layer)")
    query, key = _shape(attention[0].args[0]), _shape(attention[0].args[1])
    token = next((n for n in graph.nodes if _name(n) == "embedding" and _param(n.args[0])
                  and _reads_input(n.args[1])), None)
    if token is None:
        raise _refuse(model, "no embedding of the model's input ids (the token table)")
    vocab, hidden = _shape(token.args[0])
    projections = _projections(graph)
    down = Counter(i for i, o, _ in projections if o == hidden and i > hidden)
    moe = _experts(model, graph, hidden, repeats)
    if not down and not moe:
        raise _refuse(model, f"no MLP (a projection back to the hidden width {hidden} from a "
                             f"wider one)")
    if down:
        ffn, downs = down.most_common(1)[0]
        ups = sum(1 for i, o, _ in projections if i == hidden and o == ffn)
        fused = any(i == hidden and o == 2 * ffn for i, o, _ in projections)
        gated = fused or ups >= 2 * downs
    if moe and down and (moe["ffn"], moe["gated"]) != (ffn, gated):
        raise _refuse(model, f"expert MLPs of width {moe['ffn']} beside dense MLPs of width "
                             f"{ffn} (one width is priced)")
    if moe:
        ffn, gated = moe["ffn"], moe["gated"]
    head = next((name for i, o, name in reversed(projections) if i == hidden and o == vocab),
                None)
    heads, kv_heads = query[-3], key[-3]
    layers = len(attention) * repeats
    return TransformerShape(
        layers=layers, hidden=hidden, heads=heads, seq=query[-2], vocab=vocab,
        ffn=ffn, kv_heads=kv_heads if kv_heads != heads else 0, gated=gated,
        tied=head is None or head == _param(token.args[0]),
        experts=moe["experts"] if moe else 0, top_k=moe["top_k"] if moe else 0,
        moe_layers=moe["layers"] if moe and moe["layers"] < layers else 0)


def _experts(model: nn.Module, graph: fx.Graph, hidden: int, repeats: int) -> dict | None:
    """The mixture of experts the graph shows (module docstring), or None."""
    stacked = [_shape(n) for n in graph.nodes if n.op == "get_attr" and len(_shape(n)) == 3
               and hidden in _shape(n)[1:] and _shape(n)[0] > 1]
    if not stacked:
        return None
    experts = Counter(s[0] for s in stacked).most_common(1)[0][0]
    widths = sorted({s[1] if s[2] == hidden else s[2] for s in stacked if s[0] == experts})
    choices = [n for n in graph.nodes if _name(n) == "topk"
               and _shape(n.args[0])[-1:] == (experts,)]
    if not choices:
        raise _refuse(model, f"stacked expert weights ({experts} experts) but no top-k choice "
                             f"over {experts} router scores")
    top_k = int(choices[0].args[1])
    return {"experts": experts, "top_k": top_k, "layers": len(choices) * repeats,
            "ffn": widths[0], "gated": 2 * widths[0] in widths}
