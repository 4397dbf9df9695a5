"""Multi-copy parallel: split the batch into copies so one copy's communication overlaps another
copy's compute (MindSpore's ``MicroBatchInterleaved``; ``comp_comm_parallel`` for MoE).

``parallel.multi_copy(model, copies=2)``:

* **MoE layers** (``parallel.nn.MoE``) get ``copies``: routing, capacity and the balancing loss
  still see the whole batch, while the dispatch all-to-all, expert compute and combine all-to-all
  run per copy, each copy's exchange in flight while another copy's experts compute. Results are
  the single-copy layer's exactly. The model itself is returned.
* **Semi-auto models** are wrapped in :class:`MultiCopy`: the root's ``forward`` is traced with
  torch.fx, every submodule a leaf, and the copies run that graph in lockstep, node by node —
  copy 0's submodule, copy 1's, then the next submodule. Semi-auto issues its redistributions
  (partial-sum reductions, gathers) asynchronously and they are waited on first use, so copy
  ``i``'s collective is on the wire while copy ``i + 1`` computes the same submodule (output
  placements are issued without waiting inside ``MultiCopy`` only; input redistributions stay
  synchronous: issued asynchronously they left parameters without gradients in this
  project's tests on torch 2.13). The
  outputs are concatenated along the batch (0-d outputs, e.g. a mean loss, averaged); one
  backward over them accumulates every copy's gradients, equal to the single-copy model's.

Why not a hand-written overlap inside each layer (DeepSpeed Domino) or threads: a graph of the
root's submodule calls is deterministic (every rank issues its collectives in the same order,
which collectives require) and needs no change to the user's layers.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import DTensor

from foundation.model_view import ModelView
from parallel.nn.moe import MoE
from parallel.semi_auto.execute import overlapped_outputs
from parallel.semi_auto.hooks import root_io


class _EverySubmoduleALeaf(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


def _split(value: Any, copies: int, what: str) -> list[Any]:
    """A batched tensor split into ``copies`` along dim 0; anything else shared by all."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return [value] * copies
    if value.shape[0] < copies:
        raise ValueError(f"multi_copy: {what} has batch size {value.shape[0]}, fewer than "
                         f"copies={copies}")
    return list(value.tensor_split(copies))


def _merge(outputs: list[Any]) -> Any:
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(outputs).mean(0) if first.dim() == 0 else torch.cat(outputs)
    if isinstance(first, (tuple, list)):
        return type(first)(_merge(list(parts)) for parts in zip(*outputs, strict=True))
    if isinstance(first, dict):
        return {key: _merge([o[key] for o in outputs]) for key in first}
    return first


def _trace(model: nn.Module, none_args: frozenset[str]) -> fx.GraphModule:
    """The root's forward as a graph of submodule calls, the arguments in ``none_args`` fixed to
    None (so ``if targets is not None`` takes the branch the call takes)."""
    try:
        graph = _EverySubmoduleALeaf().trace(model, concrete_args=dict.fromkeys(none_args))
    except Exception as err:  # fx's own errors name the construct it cannot follow
        raise ValueError(f"multi_copy traces {type(model).__name__}.forward with torch.fx "
                         f"to interleave its submodules, and tracing failed: {err}") from err
    return fx.GraphModule(model, graph)


class MultiCopy(ModelView):
    """A semi-auto model run as ``copies`` interleaved copies (see the module docstring).

    ``io``: the semi-auto root's boundary (``root_io``) when ``model`` is not that root itself
    but a pipeline stage carved from it (sharing its modules and hooks). The forward is traced
    once per pattern of arguments passed as None (first: those whose default is None, so a
    tracing failure shows at wrap time)."""

    def __init__(self, model: nn.Module, copies: int,
                 io: tuple[Callable, Callable] | None = None) -> None:
        io = io if io is not None else root_io(model)
        if io is None:
            raise ValueError("multi_copy interleaves the submodules of a semi-auto model, but "
                             "semi-auto did not parallelize this model's root module's body (no "
                             "strategies, or a strategy on the root itself)")
        signature = inspect.signature(model.forward)
        defaults = frozenset(n for n, p in signature.parameters.items() if p.default is None)
        graph_module = _trace(model, defaults)
        super().__init__(model)
        object.__setattr__(self, "graph_module", graph_module)
        object.__setattr__(self, "_graphs", {defaults: graph_module})
        self.copies, self._inputs, self._outputs = copies, *io
        self._signature = signature

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        names = list(bound.arguments)
        nones = frozenset(n for n in names if bound.arguments[n] is None)
        if nones not in self._graphs:
            self._graphs[nones] = _trace(self._model, nones)
        graph_module = self._graphs[nones]
        per_copy = list(zip(*(_split(bound.arguments[n], self.copies, f"argument '{n}'")
                              for n in names), strict=True))
        runners = []
        for values in per_copy:
            copy_args, _ = self._inputs(self._model, tuple(values), {})
            runner = fx.Interpreter(graph_module)
            runner.env, runner.args_iter = {}, iter(copy_args)
            runners.append(runner)
        outputs: list[Any] = [None] * self.copies
        with overlapped_outputs():
            for node in graph_module.graph.nodes:  # lockstep: node n of every copy
                for c, runner in enumerate(runners):
                    value = runner.run_node(node)
                    if node.op == "output":
                        outputs[c] = self._outputs(self._model, (), value)
                    else:
                        runner.env[node] = value
                    for done in runner.user_to_last_uses.get(node, []):
                        del runner.env[done]
        return _merge(outputs)


def multi_copy(model: nn.Module, copies: int = 2) -> nn.Module:
    """``model`` with its communication overlapped across ``copies`` copies of the batch (see the
    module docstring): MoE layers split their expert work in place (the model is returned), a
    semi-auto model is wrapped in :class:`MultiCopy`."""
    if not isinstance(copies, int) or isinstance(copies, bool) or copies < 1:
        raise ValueError(f"multi_copy: copies must be a positive int, got {copies!r}")
    inner = model
    while isinstance(inner, ModelView):  # a wrapper (DataParallel) shares the model's modules
        inner = inner.module
    layers = [m for m in inner.modules() if isinstance(m, MoE)]
    if layers:
        for layer in layers:
            layer.copies = copies
        return model
    if copies == 1:
        return model
    if not any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError("multi_copy overlaps the forward communication of semi-auto "
                         "redistributions or MoE all-to-alls, and this model has neither "
                         "(data-parallel gradient reductions already overlap backward)")
    return MultiCopy(model, copies)


__all__ = ["MultiCopy", "multi_copy"]
