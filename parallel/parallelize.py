"""``parallel.parallelize(model, config)``: the one entry point for every parallel layout.

It resolves the ``ParallelConfig`` once into a ``ParallelDims`` (the world mesh and its named
sub-meshes), applies the steps in ``compose.py``'s fixed order and returns a ``Parallelized``
result: the model to train, the config, the dims, the plan and ``explain()``.

The previous release's other doors, ``parallelize(model, mode, **options)`` and
``parallelize(model)`` reading ``set_auto_parallel_context``, were deprecated there and are gone
(CHANGELOG: ``parallelize(model, ParallelConfig(...))`` and ``ParallelConfig.from_context()``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch import nn

from parallel.auto.plan import StrategyPlan
from parallel.compose import apply_config
from parallel.config import ParallelConfig
from parallel.result import Parallelized

Plan = StrategyPlan | str | Path | Mapping[str, Any]


def parallelize(model: nn.Module, config: ParallelConfig, *,
                loss_fn: Callable[[Any, Any], Any] | None = None,
                example_inputs: tuple | Any | None = None, plan: Plan | None = None,
                init_seed: int | None = None, weights: str | Path | None = None,
                **misplaced: Any) -> Parallelized:
    """Spread ``model`` over the job's ranks as ``config`` says; returns a ``Parallelized``.

    loss_fn: ``loss_fn(output, target)`` for pipeline stages (``pipeline_degree > 1``), whose
        result's model is a ``Pipeline`` trained with ``pipe.step(inputs, target=...)``.
    example_inputs: a batch (or fake/meta tensors of its shape): a search plans on a graph
        captured from it, and the automatic stage split measures FLOPs with it.
    plan: with a ``search_mode`` — a ``StrategyPlan``, a saved plan's path or its mapping, applied
        without planning.
    init_seed: a model built on the meta device (``with torch.device("meta")``) is allocated and
        initialized after the split and sharding, each rank only what it holds, bitwise equal to
        ``parallel.materialize(model, seed=init_seed)`` in one process (default seed:
        ``torch.initial_seed()``); docs/deferred-init.md lists the modes.
    weights: a local checkpoint (a ``.safetensors`` file, a ``save_pretrained`` directory or a
        DCP directory) the values come from: a meta-device model reads each rank's block of each
        tensor as it is materialized (never the whole model), a model with values loads it at
        the end (``parallel.load_weights``). Strict: the names and global shapes must match the
        model's (tied aliases and non-persistent buffers aside), checked before anything changes.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"parallel.parallelize(model, config): model must be an nn.Module, got "
                        f"{type(model).__name__}")
    if not isinstance(config, ParallelConfig):
        raise TypeError(f"parallel.parallelize(model, config): config must be a ParallelConfig, "
                        f"got {type(config).__name__} (the mode-name and context forms of the "
                        f"previous release are gone: parallelize(model, ParallelConfig(...)), or "
                        f"ParallelConfig.from_context() for set_auto_parallel_context)")
    if misplaced:
        raise ValueError(f"parallel.parallelize: {sorted(misplaced)} are not arguments; they go "
                         f"in the ParallelConfig")
    if example_inputs is not None and not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    return apply_config(model, config, loss_fn=loss_fn, example_inputs=example_inputs,
                        plan=plan, init_seed=init_seed, weights=weights)
