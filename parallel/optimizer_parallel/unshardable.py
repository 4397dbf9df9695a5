"""Optimizers that cannot update ``Shard(0)`` slices are refused at their first step.

Elementwise optimizers (SGD, Adam(W), Adagrad, RMSprop, ``hetero.optim.OffloadAdamW``, ...) give
the same update on a slice as on the whole tensor, which is what optimizer parallel relies on.
These do not: LBFGS keeps flat history vectors over all parameters and re-evaluates the model in
a line search; SparseAdam and the row-sparse ``LazyAdam``/``FTRL`` need row-sparse gradients,
and a sharded parameter's gradient is the dense reduce-scattered slice (their tables stay
replicated: modules with ``sparse=True`` are never sharded). The user builds the optimizer after
wrapping, so the check is a global step pre-hook (torch's public one): it raises before the
first update, naming the optimizer and the rule.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

# by id, holding the parameter weakly (a WeakSet would compare tensors with ==)
_SHARDED: dict[int, weakref.ref] = {}
_REASONS = {
    "LBFGS": "it keeps flat history vectors over all parameters and re-runs the whole model in "
             "its line search",
    "SparseAdam": "it needs row-sparse gradients, and a sharded parameter's is a dense slice",
    "LazyAdam": "it needs row-sparse gradients, and a sharded parameter's is a dense slice",
    "FTRL": "it needs row-sparse gradients, and a sharded parameter's is a dense slice",
}
_installed = False


def _check(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    reason = next((why for cls in type(optimizer).__mro__
                   for name, why in _REASONS.items() if cls.__name__ == name), None)
    if reason is None:
        return
    if any(_is_sharded(p) for g in optimizer.param_groups for p in g["params"]):
        raise TypeError(f"{type(optimizer).__name__} cannot update parameters sharded by "
                        f"optimizer parallel: {reason}. Use an elementwise optimizer (AdamW, "
                        f"SGD, hetero.optim.OffloadAdamW) or leave the parameters replicated "
                        f"(ParallelConfig.parallel_optimizer_threshold, a sparse=True module)")


def _forget(key: int, _ref: weakref.ref) -> None:
    _SHARDED.pop(key, None)


def _is_sharded(p: torch.Tensor) -> bool:
    ref = _SHARDED.get(id(p))
    return ref is not None and ref() is p


def mark_sharded(params: list[torch.Tensor]) -> None:
    """Remember ``params`` as sharded, and install the step check once per process."""
    global _installed
    for p in params:
        key = id(p)
        _SHARDED[key] = weakref.ref(p, functools.partial(_forget, key))
    if not _installed:
        register_optimizer_step_pre_hook(_check)
        _installed = True
