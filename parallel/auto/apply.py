"""``parallel.parallelize(model, mode="auto_parallel")``: plan, then apply the plan as semi-auto.

The plan (:func:`~parallel.auto.plan.plan_auto_parallel`, or one given with ``plan=``: a
``StrategyPlan``, a saved plan's path, or its mapping) is split in two: strategies keyed by a
``parallel.shard`` operator's attribute path are assigned to that operator, and the rest (module
paths) go to semi-auto as ``strategies=``. Semi-auto then does everything it does for a
hand-written strategy map (layout checks, one mesh, DTensor parameters, hooks,
``explain_sharding``), so the numerics and autodiff it guarantees carry over.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from parallel.auto.plan import SEARCH_MODES, StrategyPlan, load_plan, plan_auto_parallel
from parallel.semi_auto import parallelize_semi_auto
from parallel.semi_auto.shard import module_tag
from parallel.semi_auto.trace import sharded_ops

Plan = StrategyPlan | str | Path | Mapping[str, Any]
_APPLIED: weakref.WeakKeyDictionary[nn.Module, StrategyPlan] = weakref.WeakKeyDictionary()


def applied_plan(model: nn.Module) -> StrategyPlan | None:
    """The plan ``mode="auto_parallel"`` made for ``model`` (None when it was given one)."""
    return _APPLIED.get(model)


def _strategy_map(plan: Plan) -> dict[str, Any]:
    if isinstance(plan, StrategyPlan):
        return plan.strategies
    if isinstance(plan, (str, Path)):
        return load_plan(plan)
    return dict(plan)


def apply_auto_parallel(model: nn.Module, *, device_num: int,
                        strategies: Mapping[str, Any] | None = None,
                        example_inputs: tuple | None = None,
                        search_mode: str = "sharding_propagation",
                        plan: Plan | None = None) -> nn.Module:
    """Plan ``model`` on ``device_num`` devices (or take ``plan``) and apply it in place."""
    if search_mode not in SEARCH_MODES:
        raise ValueError(f"auto_parallel: search_mode {search_mode!r} is not one of "
                         f"{SEARCH_MODES}")
    if plan is None:
        if example_inputs is None:
            raise ValueError("auto_parallel plans on a captured graph: pass example_inputs (a "
                             "batch, or fake/meta tensors of its shape), or plan= a saved plan")
        plan = plan_auto_parallel(model, example_inputs, device_num=device_num,
                                  search_mode=search_mode, strategies=dict(strategies or {}))
        _APPLIED[model] = plan
    elif strategies:
        raise ValueError("auto_parallel: give annotations (strategies=) or a plan, not both")
    chosen = _strategy_map(plan)
    ops = dict(sharded_ops(model))
    modules = dict(model.named_modules())
    unknown = [key for key in chosen if key not in ops and key not in modules]
    if unknown:
        raise ValueError(f"auto_parallel: the plan names {unknown}, which are neither modules "
                         f"nor parallel.shard operators of {type(model).__name__}")
    planned = {key: ops[key] for key in chosen if key in ops and ops[key].in_strategy is None}
    # every planned module is tagged, replicated ones too: left untagged, DTensor's own
    # per-operator propagation would choose their layouts again (measured: more collectives)
    module_map = {key: strategy for key, strategy in chosen.items()
                  if key in modules and module_tag(modules[key]) is None}
    try:
        for key, op in planned.items():
            op.assign(chosen[key])
        return parallelize_semi_auto(model, device_num=device_num, strategies=module_map)
    except Exception:
        for op in planned.values():  # nothing half-applied: the operators wait for a plan again
            op.in_strategy, op.out_strategy, op.mesh = None, None, None
        raise
