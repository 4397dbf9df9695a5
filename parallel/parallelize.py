"""``parallel.parallelize``: one entry point for every parallel mode.

``parallelize(model, config)`` applies a ``parallel.ParallelConfig`` (hybrid.py: pipeline →
placement → semi-auto sharding → data parallel, on one ``(pp, dp, mp)`` mesh).
``parallelize(model, mode)`` / ``parallelize(model, mode=...)`` / ``parallelize(model)`` (the
``set_auto_parallel_context`` mode) keep working as before: one mode over the whole world.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from parallel.auto.apply import apply_auto_parallel
from parallel.config import ParallelConfig
from parallel.context import (
    ParallelMode,
    get_auto_parallel_context,
    is_explicit,
    whole_world_device_num,
)
from parallel.data_parallel import DataParallel
from parallel.hybrid import apply_config
from parallel.semi_auto import parallelize_semi_auto

_BUILT = (ParallelMode.STAND_ALONE, ParallelMode.DATA_PARALLEL, ParallelMode.SEMI_AUTO_PARALLEL,
          ParallelMode.AUTO_PARALLEL)


def parallelize(model: nn.Module, config: ParallelConfig | ParallelMode | str | None = None, *,
                mode: ParallelMode | str | None = None, device_num: int | None = None,
                strategies: Mapping[str, Any] | None = None,
                loss_fn: Callable[[Any, Any], Any] | None = None,
                example_inputs: tuple | None = None, **options: Any) -> nn.Module:
    """Spread ``model`` over the job's ranks.

    With a ``ParallelConfig``: everything it describes (see ``parallel.hybrid``); pipeline
    stages need ``loss_fn(output, target)`` and return a ``Pipeline`` trained with
    ``pipe.step(inputs, target=...)``; ``example_inputs`` (a batch) lets the automatic stage
    split measure FLOPs and placement capture early.

    With no mode and a context that sets ``pipeline_stages`` (or ``enable_parallel_optimizer``):
    the context as a config (``ParallelConfig.from_context()``), so no setting is ignored.

    With a mode (argument, ``mode=``, or the auto-parallel context's):
    ``semi_auto_parallel`` shards the model in place by its ``parallel.shard`` tags and by
    ``strategies`` (module-path patterns -> strategy, e.g. ``{"blocks.*.mlp.0": ((2, 1, 1),
    (2, 1))}``); ``device_num`` defaults to the context's, else the world size; every rank feeds
    the same whole batch. ``data_parallel`` returns
    ``parallel.DataParallel(model)``; ``options`` may set ``gradients_mean``,
    ``parameter_broadcast`` (default: the context's) and ``bucket_cap_mb``; every rank feeds its
    own shard of the batch (``parallel.shard_dataset``). ``auto_parallel`` plans the
    strategies of every operator from the annotations (``parallel.shard`` tags, ``strategies``)
    on a graph captured from ``example_inputs`` and applies the plan as semi-auto
    (``parallel.auto``); ``options`` may set ``search_mode`` (``"sharding_propagation"``) and
    ``plan`` (a ``StrategyPlan`` or a saved plan's path, applied without planning).
    """
    if isinstance(config, ParallelConfig):
        extra = {"mode": mode, "device_num": device_num, "strategies": strategies, **options}
        given = sorted(k for k, v in extra.items() if v is not None)
        if given:
            raise ValueError(f"parallel.parallelize: {given} go in the ParallelConfig when one "
                             f"is given")
        return apply_config(model, config, loss_fn=loss_fn, example_inputs=example_inputs)
    if config is not None and mode is not None:
        raise ValueError("parallel.parallelize: give the mode once (positional or mode=)")
    mode = config if config is not None else mode
    from_context = mode is None
    if from_context and (get_auto_parallel_context("pipeline_stages") > 1
                         or get_auto_parallel_context("enable_parallel_optimizer")):
        if device_num is not None or strategies or options:
            raise ValueError("parallel.parallelize: with pipeline stages or optimizer parallel "
                             "in the context, give the rest in a ParallelConfig too")
        return apply_config(model, ParallelConfig.from_context(), loss_fn=loss_fn,
                            example_inputs=example_inputs)
    if from_context:
        mode = get_auto_parallel_context("parallel_mode")
        if mode is ParallelMode.STAND_ALONE:
            raise ValueError("parallel.parallelize: no mode given and the auto-parallel context is "
                             "stand_alone; pass mode=... or call set_auto_parallel_context("
                             "parallel_mode=...) first")
    try:
        mode = ParallelMode(mode)
    except ValueError:
        raise ValueError(f"parallel.parallelize: unknown mode {mode!r}; modes are "
                         f"{[m.value for m in ParallelMode]}") from None
    if mode is ParallelMode.HYBRID_PARALLEL:
        raise ValueError("parallel.parallelize: mode 'hybrid_parallel' needs the model-parallel "
                         "degree the model's own collectives span: parallelize(model, "
                         "ParallelConfig(mode='hybrid_parallel', model=M))")
    if mode not in _BUILT:
        raise ValueError(f"parallel.parallelize: mode {mode.value!r} is not built yet; built "
                         f"modes are {[m.value for m in _BUILT]}")
    if mode is ParallelMode.AUTO_PARALLEL:
        return _auto_parallel(model, device_num, strategies, example_inputs, loss_fn, options)
    if loss_fn is not None or example_inputs is not None:
        raise ValueError("parallel.parallelize: loss_fn and example_inputs go with a "
                         "ParallelConfig (pipeline stages) or mode='auto_parallel', not "
                         f"{mode.value!r}")
    if mode is ParallelMode.SEMI_AUTO_PARALLEL:
        if options:
            raise ValueError(f"parallel.parallelize: {sorted(options)} do not apply to "
                             f"semi_auto_parallel")
        if from_context and not ParallelConfig.from_context().full_batch:
            raise ValueError("parallel.parallelize: the context sets full_batch=False, which "
                             "needs the data-parallel degree; use parallelize(model, "
                             "ParallelConfig(mode='semi_auto_parallel', data=..., model=..., "
                             "full_batch=False, strategies=...))")
        return parallelize_semi_auto(model, device_num=device_num, strategies=strategies)
    if strategies:
        raise ValueError(f"parallel.parallelize: strategies only apply to semi_auto_parallel, "
                         f"not {mode.value!r}")
    if mode is ParallelMode.STAND_ALONE:
        if options:
            raise ValueError(f"parallel.parallelize: {sorted(options)} do not apply to "
                             f"stand_alone")
        return model
    whole_world_device_num(device_num, "data parallel")
    options.setdefault("gradients_mean", get_auto_parallel_context("gradients_mean"))
    options.setdefault("parameter_broadcast", get_auto_parallel_context("parameter_broadcast"))
    return DataParallel(model, **options)



def _auto_parallel(model: nn.Module, device_num: int | None,
                   strategies: Mapping[str, Any] | None, example_inputs: tuple | None,
                   loss_fn: Callable[[Any, Any], Any] | None, options: dict[str, Any]
                   ) -> nn.Module:
    if loss_fn is not None:
        raise ValueError("parallel.parallelize: loss_fn is for pipeline stages, not "
                         "auto_parallel")
    unknown = sorted(set(options) - {"search_mode", "plan"})
    if unknown:
        raise ValueError(f"parallel.parallelize: {unknown} do not apply to auto_parallel")
    search_mode = options.get("search_mode") or (
        get_auto_parallel_context("search_mode") if is_explicit("search_mode")
        else "sharding_propagation")
    if example_inputs is not None and not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    return apply_auto_parallel(model, device_num=whole_world_device_num(device_num,
                                                                        "auto parallel"),
                               strategies=strategies, example_inputs=example_inputs,
                               search_mode=search_mode, plan=options.get("plan"))
