"""``parallel.parallelize``: one entry point for every parallel mode.

The mode comes from the argument or from ``set_auto_parallel_context(parallel_mode=...)``. Built
so far: ``data_parallel`` (``parallel.DataParallel``, its switches defaulting to the context's
``gradients_mean`` and ``parameter_broadcast``), ``semi_auto_parallel`` (``parallel.semi_auto``)
and ``stand_alone`` (the model as it is).
Modes are applied in one documented order as they arrive (placement -> semi-auto/auto sharding ->
pipeline split -> data/optimizer parallel); a mode not built yet is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from parallel.context import ParallelMode, get_auto_parallel_context, whole_world_device_num
from parallel.data_parallel import DataParallel
from parallel.semi_auto import parallelize_semi_auto


def _stand_alone(model: nn.Module, *, device_num: int | None = None) -> nn.Module:
    return model


def _data_parallel(model: nn.Module, *, device_num: int | None = None,
                   gradients_mean: bool | None = None, parameter_broadcast: bool | None = None,
                   bucket_cap_mb: float = 25) -> nn.Module:
    whole_world_device_num(device_num, "data parallel")
    if gradients_mean is None:
        gradients_mean = get_auto_parallel_context("gradients_mean")
    if parameter_broadcast is None:
        parameter_broadcast = get_auto_parallel_context("parameter_broadcast")
    return DataParallel(model, gradients_mean=gradients_mean,
                        parameter_broadcast=parameter_broadcast, bucket_cap_mb=bucket_cap_mb)


_MODES: dict[ParallelMode, Callable[..., nn.Module]] = {
    ParallelMode.STAND_ALONE: _stand_alone,
    ParallelMode.DATA_PARALLEL: _data_parallel,
    ParallelMode.SEMI_AUTO_PARALLEL: parallelize_semi_auto,
}


def parallelize(model: nn.Module, mode: ParallelMode | str | None = None, *,
                device_num: int | None = None, strategies: Mapping[str, Any] | None = None,
                **options: Any) -> nn.Module:
    """Spread ``model`` over the job's ranks in ``mode`` (default: the auto-parallel context's).

    ``semi_auto_parallel``: the model is sharded in place by its ``parallel.shard`` tags and by
    ``strategies`` (module-path patterns -> strategy, e.g. ``{"blocks.*.mlp.0": ((2, 1, 1),
    (2, 1))}``); ``device_num`` defaults to the context's, else the world size. Every rank must
    then feed the same whole batch. Returns the model.

    ``data_parallel``: returns ``parallel.DataParallel(model)``; ``options`` may set
    ``gradients_mean``, ``parameter_broadcast`` (default: the context's) and ``bucket_cap_mb``.
    Every rank then feeds its own shard of the batch (``parallel.shard_dataset``).
    """
    if mode is None:
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
    if mode not in _MODES:
        raise ValueError(f"parallel.parallelize: mode {mode.value!r} is not built yet; built modes "
                         f"are {[m.value for m in _MODES]}")
    if mode is ParallelMode.SEMI_AUTO_PARALLEL:
        if options:
            raise ValueError(f"parallel.parallelize: {sorted(options)} do not apply to "
                             f"semi_auto_parallel")
        return parallelize_semi_auto(model, device_num=device_num, strategies=strategies)
    if strategies:
        raise ValueError(f"parallel.parallelize: strategies only apply to semi_auto_parallel, "
                         f"not {mode.value!r}")
    if mode is ParallelMode.STAND_ALONE and options:
        raise ValueError(f"parallel.parallelize: {sorted(options)} do not apply to stand_alone")
    return _MODES[mode](model, device_num=device_num, **options)
