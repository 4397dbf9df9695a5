"""Find which parameters feed which sharded operators, so they can start in the right layout.

A ``ShardedOp`` called in a module's ``forward`` (``self.matmul(x, self.weight)``) consumes
parameters nobody declared to it. The reference learns this from its whole-graph compile; here
``torch.fx`` traces each module that holds sharded operators, only its own ``forward`` (every
submodule a leaf), and reads the ``get_attr`` nodes that flow straight into a sharded operator.
A forward that fx cannot trace is reported back (``parallelize`` warns): its parameters stay
replicated and each call slices them, which is correct but holds them whole on every rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch.fx as fx
from torch import nn

from parallel.semi_auto.shard import ShardedOp


@dataclasses.dataclass(frozen=True)
class ParameterUse:
    """Parameter ``name`` is input ``index`` of sharded operator ``op`` (``op`` at ``op_path``)."""

    op: ShardedOp
    op_path: str
    name: str
    param: nn.Parameter
    index: int
    info: dict[str, Any]


class _OwnForwardTracer(fx.Tracer):
    """Traces one module's own forward: every submodule is a leaf."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


def sharded_ops(model: nn.Module) -> list[tuple[str, ShardedOp]]:
    """Every ShardedOp held as a module attribute, with its path (``block.matmul``)."""
    found = []
    for path, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, ShardedOp):
                found.append((f"{path}.{attr}" if path else attr, value))
    return found


def _op_path(module_path: str, module: nn.Module, op: ShardedOp) -> str:
    attr = next((a for a, v in vars(module).items() if v is op), op.name)
    return f"{module_path}.{attr}" if module_path else attr


def _untagged_parameters(module: nn.Module, tagged: set[int]) -> list[str]:
    """Parameters under ``module`` not owned by a tagged module: a sharded operator could use
    them without a layout of their own."""
    return [f"{path}.{name}" if path else name for path, sub in module.named_modules()
            if id(sub) not in tagged for name, _ in sub.named_parameters(recurse=False)]


def parameter_uses(model: nn.Module, tagged: Iterable[nn.Module] = ()
                   ) -> tuple[list[ParameterUse], list[str]]:
    """Parameters flowing directly into sharded operators; and the forwards fx could not trace
    (only those holding parameters of untagged modules: others have nothing to miss)."""
    tagged_ids = {id(m) for m in tagged}
    uses: list[ParameterUse] = []
    untraced: list[str] = []
    for path, module in model.named_modules():
        if not any(isinstance(v, ShardedOp) for v in vars(module).values()):
            continue
        try:
            graph = _OwnForwardTracer().trace(module)
        except Exception as err:  # fx raises many kinds; every one means "not traceable"
            if candidates := _untagged_parameters(module, tagged_ids):  # else none to miss
                untraced.append(f"{path or type(model).__name__}.forward ({type(err).__name__}: "
                                f"{err}; parameters: {', '.join(candidates)})")
            continue
        for node in graph.nodes:
            if node.op != "call_function" or not isinstance(node.target, ShardedOp):
                continue
            op = node.target
            if op.in_strategy is None:  # not planned: runs as the plain operator
                continue
            try:
                info = op.rule.info(node.args, node.kwargs)
            except ValueError:
                info = {}  # a setting computed at run time; the call itself will check it
            for index, value in enumerate(op.rule.bind(node.args, node.kwargs)):
                if not (isinstance(value, fx.Node) and value.op == "get_attr"):
                    continue
                name = f"{path}.{value.target}" if path else str(value.target)
                try:
                    param = model.get_parameter(name)
                except AttributeError:
                    continue  # a buffer or plain attribute: converted as replicated
                uses.append(ParameterUse(op, _op_path(path, module, op), name, param, index,
                                         info))
    return uses, untraced
