"""The auto-parallel context: the settings of the reference's ``set_auto_parallel_context``.

One process-wide record of how the user wants the job parallelised (mode, device count, gradient
mean, parameter broadcast, strategy-search mode, optimizer parallel, pipeline stages, full batch).
``parallel.parallelize`` and the recipes read it. Every update is validated in full before any of
it is applied, so a bad call leaves the context as it was.
"""

from __future__ import annotations

import dataclasses
from enum import Enum
from typing import Any

import torch.distributed as dist


class ParallelMode(str, Enum):
    """How a network is spread over devices (the reference's five modes)."""

    STAND_ALONE = "stand_alone"
    DATA_PARALLEL = "data_parallel"
    SEMI_AUTO_PARALLEL = "semi_auto_parallel"
    AUTO_PARALLEL = "auto_parallel"
    HYBRID_PARALLEL = "hybrid_parallel"


SEARCH_MODES = ("recursive_programming", "dynamic_programming", "sharding_propagation")


@dataclasses.dataclass
class _Context:
    parallel_mode: ParallelMode = ParallelMode.STAND_ALONE
    device_num: int | None = None  # None: the world size at parallelize time
    gradients_mean: bool = False
    parameter_broadcast: bool = False
    search_mode: str = "dynamic_programming"
    enable_parallel_optimizer: bool = False
    parallel_optimizer_config: dict = dataclasses.field(default_factory=dict)
    pipeline_stages: int = 1
    full_batch: bool = False


_OPTIMIZER_KEYS = ("optimizer_level", "optimizer_weight_shard_size",
                   "parallel_optimizer_threshold")
_context = _Context()
_explicit: set[str] = set()  # settings the user has set (ParallelConfig.from_context reads them)
_NAMES = tuple(f.name for f in dataclasses.fields(_Context))


def _check_name(name: str) -> None:
    if name not in _NAMES:
        raise ValueError(f"unknown auto-parallel setting {name!r}; the settings are {_NAMES}")


def _validate(name: str, value: Any) -> Any:
    """Return ``value`` in its stored form, or raise naming ``name`` and the rule it breaks."""
    _check_name(name)
    if name == "parallel_mode":
        if not isinstance(value, str):  # ParallelMode is a str too
            raise TypeError(
                f"parallel_mode must be a ParallelMode or str, got {type(value).__name__}"
            )
        try:
            return ParallelMode(value)
        except ValueError:
            raise ValueError(
                f"parallel_mode {value!r} is not one of {[m.value for m in ParallelMode]}"
            ) from None
    if name == "search_mode":
        if not isinstance(value, str):
            raise TypeError(f"search_mode must be a str, got {type(value).__name__}")
        if value not in SEARCH_MODES:
            raise ValueError(f"search_mode {value!r} is not one of {SEARCH_MODES}")
        return value
    if name in ("device_num", "pipeline_stages"):
        if value is None and name == "device_num":
            return None
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
        return value
    if name == "parallel_optimizer_config":
        if not isinstance(value, dict):
            raise TypeError(f"parallel_optimizer_config must be a dict, got "
                            f"{type(value).__name__}")
        unknown = sorted(set(value) - set(_OPTIMIZER_KEYS))
        if unknown:
            raise ValueError(f"parallel_optimizer_config: unknown keys {unknown}; the keys are "
                             f"{_OPTIMIZER_KEYS}")
        return dict(value)  # the values are checked by ParallelConfig
    if not isinstance(value, bool):  # the remaining settings are switches
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def set_auto_parallel_context(**settings: Any) -> None:
    """Update some settings; all are checked first, so an error changes nothing.

    >>> set_auto_parallel_context(parallel_mode=ParallelMode.DATA_PARALLEL, gradients_mean=True)
    """
    checked = {name: _validate(name, value) for name, value in settings.items()}
    for name, value in checked.items():
        setattr(_context, name, value)
    _explicit.update(checked)


def get_auto_parallel_context(name: str) -> Any:
    """The current value of one setting."""
    _check_name(name)
    return getattr(_context, name)


def is_explicit(name: str) -> bool:
    """Whether the user set ``name`` (rather than it holding its default)."""
    _check_name(name)
    return name in _explicit


def reset_auto_parallel_context() -> None:
    """Every setting back to its default."""
    global _context
    _context = _Context()
    _explicit.clear()


def resolve_device_num(explicit: int | None = None) -> int | None:
    """How many devices a parallel mode spreads over: ``explicit``, else the context's
    ``device_num``, else the world size (None before ``parallel.init()``). The one place this is
    decided, for every mode."""
    if explicit is not None:
        return explicit
    value = get_auto_parallel_context("device_num")
    if value is None and dist.is_initialized():
        value = dist.get_world_size()
    return value


def whole_world_device_num(explicit: int | None, mode: str) -> int:
    """:func:`resolve_device_num` for a mode that runs on every rank: ValueError unless it is
    the world size."""
    if not dist.is_initialized():
        raise RuntimeError(f"{mode} needs the process group: call parallel.init() first (it also "
                           f"works in a plain single process)")
    world = dist.get_world_size()
    device_num = resolve_device_num(explicit)
    if device_num != world:
        raise ValueError(f"{mode}: device_num={device_num} must equal the world size {world}: "
                         f"{mode} spreads the model over every rank of the job")
    return device_num
