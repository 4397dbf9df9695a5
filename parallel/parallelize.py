"""``parallel.parallelize(model, config)``: the one entry point for every parallel mode.

It resolves the ``ParallelConfig`` once into a ``ParallelDims`` (the world mesh and its named
sub-meshes), applies the modes in hybrid.py's fixed order and returns a ``Parallelized`` result:
the model to train, the config, the dims, the plan and ``explain()``.

The previous release's doors still open for one release, each with a ``DeprecationWarning`` and
returning the bare model as they did: ``parallelize(model, mode, **options)`` (a mode name and
its options, made into a config here) and ``parallelize(model)`` (the
``set_auto_parallel_context`` settings: ``ParallelConfig.from_context()``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from parallel.auto.plan import StrategyPlan
from parallel.compose import apply_config
from parallel.config import ParallelConfig, ParallelMode, mode_fields
from parallel.context import check_device_num
from parallel.data.replicas import DataParallel
from parallel.result import Parallelized
from parallel.semi_auto import parallelize_semi_auto

Plan = StrategyPlan | str | Path | Mapping[str, Any]


def parallelize(model: nn.Module, config: ParallelConfig | ParallelMode | str | None = None, *,
                loss_fn: Callable[[Any, Any], Any] | None = None,
                example_inputs: tuple | Any | None = None, plan: Plan | None = None,
                init_seed: int | None = None, weights: str | Path | None = None,
                **deprecated: Any) -> Parallelized | nn.Module:
    """Spread ``model`` over the job's ranks as ``config`` says; returns a ``Parallelized``.

    loss_fn: ``loss_fn(output, target)`` for pipeline stages (``pipeline_degree > 1``), whose
        result's model is a ``Pipeline`` trained with ``pipe.step(inputs, target=...)``.
    example_inputs: a batch (or fake/meta tensors of its shape): auto_parallel plans on a graph
        captured from it, and the automatic stage split measures FLOPs with it.
    plan: auto_parallel — a ``StrategyPlan``, a saved plan's path or its mapping, applied
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
    if isinstance(config, ParallelConfig):
        if deprecated:
            raise ValueError(f"parallel.parallelize: {sorted(deprecated)} are not arguments; "
                             f"they go in the ParallelConfig")
        if example_inputs is not None and not isinstance(example_inputs, tuple):
            example_inputs = (example_inputs,)
        return apply_config(model, config, loss_fn=loss_fn, example_inputs=example_inputs,
                            plan=plan, init_seed=init_seed, weights=weights)
    if init_seed is not None or weights is not None:
        raise ValueError("parallel.parallelize: init_seed and weights need a ParallelConfig")
    return _previous_release(model, config, loss_fn, example_inputs, plan, deprecated)


def _previous_release(model: nn.Module, mode: ParallelMode | str | None,
                      loss_fn: Callable[[Any, Any], Any] | None, example_inputs: Any,
                      plan: Plan | None, options: dict[str, Any]) -> nn.Module:
    """``parallelize(model, mode, **options)`` and ``parallelize(model)``, as they were."""
    if mode is None and "mode" in options:
        mode = options.pop("mode")
    elif "mode" in options:
        raise ValueError("parallel.parallelize: give the mode once (positional or mode=)")
    if mode is None:
        warnings.warn("parallel.parallelize(model) reading set_auto_parallel_context is "
                      "deprecated: use parallelize(model, ParallelConfig.from_context()).model",
                      DeprecationWarning, stacklevel=3)
        try:  # the previous release let strategies= (and search_mode=) join the context's
            config = ParallelConfig.from_context(**options)
        except TypeError as err:
            raise ValueError(f"parallel.parallelize: {err}") from None
        return parallelize(model, config, loss_fn=loss_fn, example_inputs=example_inputs,
                           plan=plan).model
    try:
        mode = ParallelMode(mode)
    except ValueError:
        raise ValueError(f"parallel.parallelize: unknown mode {mode!r}; modes are "
                         f"{[m.value for m in ParallelMode]}") from None
    warnings.warn(f"parallel.parallelize(model, {mode.value!r}, ...) is deprecated: use "
                  f"parallelize(model, ParallelConfig(mode={mode.value!r}, ...)).model",
                  DeprecationWarning, stacklevel=3)
    device_num = options.pop("device_num", None)
    check_device_num(device_num, "parallel.parallelize", mode.value)
    if mode is ParallelMode.SEMI_AUTO_PARALLEL:
        # a model tagged by parallel.shard alone, with no data/tensor split to describe
        if options.keys() - {"strategies"} or loss_fn is not None or example_inputs is not None:
            raise ValueError(f"parallel.parallelize: {sorted(options)} do not apply to "
                             f"semi_auto_parallel")
        return parallelize_semi_auto(model, device_num=device_num,
                                     strategies=options.get("strategies"))
    if mode is ParallelMode.DATA_PARALLEL and "bucket_cap_mb" in options:
        if not dist.is_initialized():
            raise RuntimeError("data parallel needs the process group: call parallel.init() "
                               "first (it also works in a plain single process)")
        return DataParallel(model, **options)
    if "strategies" in options and mode is not ParallelMode.AUTO_PARALLEL:
        raise ValueError(f"parallel.parallelize: strategies only apply to semi_auto_parallel, "
                         f"not {mode.value!r}")
    try:
        config = ParallelConfig(**{**options, **mode_fields(mode, options, "parallel.parallelize")})
    except TypeError as err:
        raise ValueError(f"parallel.parallelize: {err}") from None
    if mode is ParallelMode.STAND_ALONE:
        return model
    if mode is ParallelMode.DATA_PARALLEL and dist.is_initialized() and \
            dist.get_world_size() == 1:
        # the previous release wrapped even one process (its reducer is then a no-op)
        return DataParallel(model, gradients_mean=config.gradients_mean,
                            parameter_broadcast=config.parameter_broadcast)
    return parallelize(model, config, loss_fn=loss_fn, example_inputs=example_inputs,
                       plan=plan).model
