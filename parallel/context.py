"""MindSpore's ``set_auto_parallel_context``: a thin adapter that builds a ``ParallelConfig``.

The context records the settings the user gives, nothing more; its defaults are
``ParallelConfig``'s (there is one set of defaults), and ``ParallelConfig.from_context()`` turns
the recorded settings into a config. Nothing in the library reads the context behind the user's
back: ``parallel.parallelize(model, ParallelConfig.from_context())`` is how it reaches a model.

It accepts every ``ParallelConfig`` field under its own name (``data_degree=2``,
``schedule="zbv"``, ...) and the reference's spellings: ``pipeline_stages``
(``pipeline_degree``), ``parallel_optimizer_config`` (a dict of the optimizer fields),
``device_num`` (checked against the world size at ``parallelize``) and ``parallel_mode``. The mode
is the one setting ``ParallelConfig`` does not have: it is translated here, once, into the fields
that say the same (``parallel.config.mode_fields``: ``auto_parallel`` is a ``search_mode``,
``stand_alone`` one replica; the others follow from the strategies and degrees). Every
update is validated in full before any of it is applied, so a bad call leaves the context as it
was.
"""

from __future__ import annotations

import dataclasses
import warnings
from types import SimpleNamespace
from typing import Any

import torch.distributed as dist

from parallel.config import (
    FIELDS,
    RENAMED,
    SEARCH_MODES,
    ParallelConfig,
    ParallelMode,
    _renamed,
    check_field,
    mode_fields,
    operator_split,
)

__all__ = ["ParallelMode", "SEARCH_MODES", "get_auto_parallel_context",
           "reset_auto_parallel_context", "set_auto_parallel_context"]

#: the reference's names -> ParallelConfig's
ALIASES = {"pipeline_stages": "pipeline_degree"}
_OPTIMIZER_KEYS = ("optimizer_level", "optimizer_weight_shard_size",
                   "parallel_optimizer_threshold")
_OWN = ("device_num", "parallel_optimizer_config", "parallel_mode")
_NAMES = (*FIELDS, *ALIASES, *_OWN)
_settings: dict[str, Any] = {}  # ParallelConfig field -> value the user set; device_num too
_DEFAULTS = {f.name: (f.default_factory() if f.default_factory is not dataclasses.MISSING
                      else f.default) for f in dataclasses.fields(ParallelConfig)}


def _check_name(name: str) -> str:
    """The ParallelConfig field ``name`` stands for (``device_num``, ``parallel_mode`` and
    ``parallel_optimizer_config`` stand for themselves)."""
    if name in RENAMED:
        return RENAMED[name]
    if name not in _NAMES:
        raise ValueError(f"unknown auto-parallel setting {name!r}; the settings are "
                         f"{sorted(_NAMES)}")
    return ALIASES.get(name, name)


def _checked(name: str, value: Any) -> dict[str, Any]:
    """The fields ``name=value`` sets, in their stored form; raises naming ``name`` and its
    rule."""
    field = _check_name(name)
    if field == "device_num":
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"device_num must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"device_num must be at least 1, got {value}")
        return {"device_num": value}
    if field == "parallel_mode":
        if not isinstance(value, str):  # ParallelMode is a str too
            raise TypeError(f"parallel_mode must be a ParallelMode or str, got "
                            f"{type(value).__name__}")
        try:
            return {"parallel_mode": ParallelMode(value)}
        except ValueError:
            raise ValueError(f"parallel_mode {value!r} is not one of "
                             f"{[m.value for m in ParallelMode]}") from None
    if field == "parallel_optimizer_config":
        if not isinstance(value, dict):
            raise TypeError(f"parallel_optimizer_config must be a dict, got "
                            f"{type(value).__name__}")
        unknown = sorted(set(value) - set(_OPTIMIZER_KEYS))
        if unknown:
            raise ValueError(f"parallel_optimizer_config: unknown keys {unknown}; the keys are "
                             f"{_OPTIMIZER_KEYS}")
        return {k: check_field(k, v) for k, v in value.items()}
    try:
        return {field: check_field(field, value)}
    except (TypeError, ValueError) as err:  # name the setting as the user spelled it
        raise type(err)(str(err).replace(f"ParallelConfig.{field}", name)) from None


def set_auto_parallel_context(**settings: Any) -> None:
    """Record some settings; all are checked first, so an error changes nothing.

    >>> set_auto_parallel_context(parallel_mode=ParallelMode.DATA_PARALLEL, gradients_mean=True)
    """
    settings = _renamed(dict(settings), "set_auto_parallel_context")
    if "mode" in settings:  # ParallelConfig's field of the previous release
        if "parallel_mode" in settings:
            raise ValueError("set_auto_parallel_context: 'mode' is the old name of "
                             "'parallel_mode'; give one")
        warnings.warn("set_auto_parallel_context: 'mode' is deprecated, use 'parallel_mode'",
                      DeprecationWarning, stacklevel=2)
        settings["parallel_mode"] = settings.pop("mode")
    checked: dict[str, Any] = {}
    for name, value in settings.items():
        checked.update(_checked(name, value))
    _settings.update(checked)


def get_auto_parallel_context(name: str) -> Any:
    """The current value of one setting (``ParallelConfig``'s default where unset)."""
    field = _check_name(name)
    if field in ("device_num", "parallel_mode"):
        return _settings.get(field, None if field == "device_num" else _mode_of_fields())
    if field == "parallel_optimizer_config":
        return {k: _settings[k] for k in _OPTIMIZER_KEYS if k in _settings}
    return _settings.get(field, _DEFAULTS[field])


def reset_auto_parallel_context() -> None:
    """Every setting back to its default."""
    _settings.clear()


def check_device_num(device_num: int | None, where: str, what: str) -> None:
    """ValueError unless ``device_num`` (the reference's device count) is None or the world
    size: every mode spreads the model over every rank of the job."""
    if device_num is not None and dist.is_initialized() and \
            device_num != dist.get_world_size():
        raise ValueError(f"{where}: device_num={device_num} must equal the world size "
                         f"{dist.get_world_size()}: {what} spreads the model over every rank of "
                         f"the job")


def context_fields() -> dict[str, Any]:
    """The recorded settings as ``ParallelConfig`` fields (``ParallelConfig.from_context``); a
    ``device_num`` other than the world size is refused here, where it would be applied."""
    check_device_num(_settings.get("device_num"), "set_auto_parallel_context", "every mode")
    fields = {k: v for k, v in _settings.items() if k not in ("device_num", "parallel_mode")}
    if "parallel_mode" in _settings:
        fields.update(mode_fields(_settings["parallel_mode"], fields,
                                  "set_auto_parallel_context"))
    return fields


def _mode_of_fields() -> ParallelMode:
    """The mode the recorded fields run as, where no ``parallel_mode`` was set: read from the
    fields alone, so a getter never raises for a combination only a config refuses."""
    return operator_split(SimpleNamespace(**{**_DEFAULTS, **_settings})).reference_mode


def resolve_device_num(explicit: int | None = None) -> int | None:
    """How many devices a parallel mode spreads over: ``explicit``, else the world size (None
    before ``parallel.init()``)."""
    if explicit is not None:
        return explicit
    return dist.get_world_size() if dist.is_initialized() else None
