"""``parallel.shard``: give a module or an operator its shard strategy (the reference's
``op.shard(in_strategy, out_strategy)``).

* On a module (``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``, activations, softmax) the tag is
  kept beside the module, not on it; ``parallel.parallelize`` later makes its parameters DTensors
  of their layouts and redistributes its input before each call. The module is returned.
* On an operator (``torch.matmul``, ``torch.bmm``, ``F.linear``, elementwise ops, softmax,
  ``F.layer_norm``, ``F.embedding``, ``F.scaled_dot_product_attention``) it returns a
  ``ShardedOp``: a callable that redistributes its inputs, runs the operator on each rank's slices
  and returns a DTensor. Keep it as a module attribute (``self.matmul = parallel.shard(...)``) so
  ``parallelize`` finds it and gives the parameters it consumes their layouts.

The strategy is checked at once (entries, arity, consistency; the device count too when it is
known); shapes are checked when parameters are converted and when activations arrive.
"""

from __future__ import annotations

import contextvars
import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from parallel.context import resolve_device_num
from parallel.semi_auto.execute import (
    CallRecord,
    bring_to_layouts,
    place_output,
    run_local,
)
from parallel.semi_auto.mesh import device_mesh, mesh_shape_for
from parallel.semi_auto.registry import OP_RULES, ModuleRule, module_rule, op_name, rule_names
from parallel.semi_auto.rules import OpRule
from parallel.semi_auto.strategy import OpPlan, check_shapes, derive_plan

Strategy = tuple  # ((2, 1), (1, 2)) or (layout("dp", "None"), ...)


def known_device_num() -> int | None:
    """The device count when it is already known: the context's, else the world size."""
    return resolve_device_num()


class ModuleShard:
    """A module's tag: its rule, strategies and what happened at its last call."""

    def __init__(self, module: nn.Module, module_rule: ModuleRule, in_strategy: Strategy,
                 out_strategy: Strategy | None) -> None:
        self.module_rule = module_rule
        self.in_strategy, self.out_strategy = in_strategy, out_strategy
        self.kind = type(module).__name__
        self.record = CallRecord()

    @property
    def rule(self) -> OpRule:
        return self.module_rule.rule

    def plan(self, what: str, module: nn.Module, device_num: int | None) -> OpPlan:
        return derive_plan(what, self.rule, self.in_strategy, self.out_strategy, device_num,
                           self.module_rule.info(module))

    def forward_inputs(self) -> list[int]:
        """Rule inputs that are the forward's positional arguments, in order."""
        bound = set(self.module_rule.params.values())
        return [i for i in range(len(self.rule.input_names)) if i not in bound]

    def check_parameters(self, plan: OpPlan, module: nn.Module) -> None:
        tensors: list[Any] = [None] * len(self.rule.input_names)
        for name, index in self.module_rule.params.items():
            tensors[index] = getattr(module, name, None)
        check_shapes(plan, tensors)


_MODULE_TAGS: weakref.WeakKeyDictionary[nn.Module, ModuleShard] = weakref.WeakKeyDictionary()


def module_tag(module: nn.Module) -> ModuleShard | None:
    """The tag ``shard`` gave ``module`` (None if untagged)."""
    return _MODULE_TAGS.get(module)


def _module_rule(module: nn.Module) -> ModuleRule:
    rule = module_rule(module)
    if rule is None:
        raise ValueError(f"parallel.shard: no shard rule for {type(module).__name__}; modules "
                         f"with rules are {rule_names()}. Tag the modules inside it, or use "
                         f"parallel.shard on the operators its forward calls")
    return rule


def carries_strategies(model: nn.Module) -> bool:
    """Whether ``parallel.shard`` gave a strategy to a module of ``model`` or to an operator it
    holds (``self.matmul = parallel.shard(torch.matmul, ...)``)."""
    return any(module_tag(m) is not None or any(isinstance(v, ShardedOp) for v in vars(m).values())
               for m in model.modules())


def make_module_tag(module: nn.Module, in_strategy: Strategy, out_strategy: Strategy | None,
                    what: str | None = None) -> ModuleShard:
    """A validated tag for ``module`` (not yet attached)."""
    tag = ModuleShard(module, _module_rule(module), in_strategy, out_strategy)
    what = what or f"shard({tag.kind})"
    if any(isinstance(p, DTensor) for p in module.parameters(recurse=False)):
        raise ValueError(f"{what}: the module is already parallelized; tag modules before "
                         f"calling parallel.parallelize")
    plan = tag.plan(what, module, known_device_num())
    tag.check_parameters(plan, module)
    return tag


def attach_module_tag(module: nn.Module, tag: ModuleShard | None) -> None:
    """Give ``module`` ``tag`` (None: remove its tag)."""
    if tag is None:
        _MODULE_TAGS.pop(module, None)
    else:
        _MODULE_TAGS[module] = tag


#: set while automatic parallel captures a model: sharded operators run as their plain operator
#: and mark the graph nodes they produce with ``node.meta["custom"][SHARDED_OP_KEY] = op.serial``
PLANNING: contextvars.ContextVar[bool] = contextvars.ContextVar("planning", default=False)
SHARDED_OP_KEY = "sharded_op"
_SERIALS = itertools.count()


class ShardedOp:
    """An operator with a shard strategy (returned by ``parallel.shard(op, ...)``)."""

    def __init__(self, op: Callable, rule: OpRule, in_strategy: Strategy,
                 out_strategy: Strategy | None) -> None:
        self.op, self.rule = op, rule
        self.in_strategy, self.out_strategy = in_strategy, out_strategy
        self.name = op_name(op)
        self.serial = next(_SERIALS)  # survives the deep copy a capture makes, unlike id()
        self.what = f"shard({self.name})"
        self.__name__ = f"sharded_{getattr(op, '__name__', 'op')}"  # names its torch.fx node
        self.mesh: DeviceMesh | None = None  # set by parallelize for the model that holds it
        self.record = CallRecord()
        self._plans: dict[tuple, OpPlan] = {}
        if in_strategy is not None:  # None: the strategy is planned (a search_mode)
            derive_plan(self.what, rule, in_strategy, out_strategy, known_device_num())

    def assign(self, in_strategy: Strategy, out_strategy: Strategy | None = None) -> None:
        """Give the operator a (planned) strategy, checked as ``parallel.shard`` checks one."""
        derive_plan(self.what, self.rule, in_strategy, out_strategy, known_device_num())
        self.in_strategy, self.out_strategy = in_strategy, out_strategy
        self._plans.clear()
        self.mesh = None

    def plan(self, device_num: int | None, info: dict[str, Any] | None = None) -> OpPlan:
        key = (device_num, tuple(sorted((info or {}).items())))
        if key not in self._plans:
            self._plans[key] = derive_plan(self.what, self.rule, self.in_strategy,
                                           self.out_strategy, device_num, info)
        return self._plans[key]

    def __repr__(self) -> str:
        return (f"ShardedOp({self.name}, in_strategy={self.in_strategy}, "
                f"out_strategy={self.out_strategy})")

    def _mesh_for(self, tensors: list[Any], info: dict[str, Any]) -> DeviceMesh:
        for value in tensors:
            if isinstance(value, DTensor):
                return value.device_mesh
        if self.mesh is None:
            device_num = known_device_num()
            if device_num is None:
                raise RuntimeError(f"{self.what} needs the process group: call parallel.init() "
                                   f"first (it also works in a plain single process)")
            matrix = self.plan(device_num, info).device_matrix
            self.mesh = device_mesh(mesh_shape_for([matrix], device_num))
        return self.mesh

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        proxy = next((v for v in (*args, *kwargs.values()) if isinstance(v, fx.Proxy)), None)
        if proxy is not None:  # being traced by torch.fx (parallelize looks for parameters)
            return proxy.tracer.create_proxy("call_function", self, args, kwargs)
        if PLANNING.get():  # captured for automatic parallel: the plain op, its nodes marked
            with fx_traceback.annotate({SHARDED_OP_KEY: self.serial}):
                return self.op(*args, **kwargs)
        if self.in_strategy is None:  # awaiting a plan: the plain operator (DTensor's own rule)
            return self.op(*args, **kwargs)
        try:
            info = self.rule.info(args, kwargs)
        except ValueError as err:
            raise ValueError(f"{self.what}: {err}") from None
        tensors = self.rule.bind(args, kwargs)
        count = len(self.in_strategy)
        passed = sum(t is not None for t in tensors)
        if any(t is None for t in tensors[:count]) or passed > len(self.plan(None, info).inputs):
            raise ValueError(f"{self.what}: the call passes {passed} tensor input(s), but "
                             f"in_strategy has {count} entries (inputs: "
                             f"{', '.join(self.rule.input_names[:count])})")
        mesh = self._mesh_for(tensors, info)
        plan = self.plan(mesh.size(), info)
        check_shapes(plan, tensors)
        moved = bring_to_layouts(plan, tensors, mesh, self.record)
        if plan.local:
            def on_slices(local: list[torch.Tensor | None]) -> torch.Tensor:
                call_args, call_kwargs = self.rule.substitute(args, kwargs, local)
                return self.op(*call_args, **call_kwargs)
            out = run_local(plan, on_slices, moved, mesh)
        else:
            call_args, call_kwargs = self.rule.substitute(args, kwargs, moved)
            out = self.op(*call_args, **call_kwargs)
        return place_output(plan, out, mesh, self.record)


def shard(module_or_op: Any, in_strategy: Strategy | None = None,
          out_strategy: Strategy | None = None) -> Any:
    """Give a module or an operator its shard strategy.

    An operator may be given none (``parallel.shard(torch.matmul)``): it runs as the plain
    operator until ``parallel.parallelize(model, ParallelConfig(search_mode=...))`` plans its
    strategy.

    ``in_strategy`` has one entry per input: a tuple of slice counts per dimension (powers of
    two; ``((2, 1), (1, 2))`` for a MatMul of ``[M, K] x [K, N]``) or a layout from
    ``Layout``. For ``nn.Linear`` the entries are the input and the weight (stored
    ``[out, in]``: ``((dp, 1), (mp, 1))`` is column parallel, ``((dp, mp), (1, mp))`` row
    parallel); the bias follows the weight. ``out_strategy`` (one slice tuple) says where partial
    sums go: the derived output slices mean AllReduce, one dimension multiplied by the
    contracting slices means ReduceScatter into it; without it they stay ``Partial`` until a
    consumer needs them reduced.

    Returns the module itself, or a ``ShardedOp`` for an operator.
    """
    if isinstance(module_or_op, nn.Module):
        if in_strategy is None:
            raise ValueError(f"parallel.shard: a module ({type(module_or_op).__name__}) needs "
                             f"an in_strategy; modules without one are planned by type under "
                             f"a search (ParallelConfig.search_mode)")
        attach_module_tag(module_or_op, make_module_tag(module_or_op, in_strategy, out_strategy))
        return module_or_op
    if isinstance(module_or_op, ShardedOp):
        raise ValueError(f"parallel.shard: {module_or_op!r} is already sharded; shard the "
                         f"plain operator {module_or_op.name} instead")
    try:
        rule = OP_RULES.get(module_or_op)
    except TypeError:  # unhashable
        rule = None
    if rule is None:
        names = sorted({op_name(op) for op in OP_RULES})
        raise ValueError(f"parallel.shard: no shard rule for {module_or_op!r}; operators with "
                         f"rules are {', '.join(names)} (and the modules nn.Linear, "
                         f"nn.Embedding, nn.LayerNorm, activations, nn.Softmax)")
    return ShardedOp(module_or_op, rule, in_strategy, out_strategy)
