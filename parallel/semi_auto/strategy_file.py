"""Strategies by module path: the ``strategies=`` argument of ``parallelize`` and YAML files.

A strategy map sends module-path patterns (``fnmatch`` style: ``blocks.*.mlp.0``) to strategies,
so a model can be sharded without editing its code::

    {"blocks.*.mlp.0": ((2, 1, 1), (2, 1)),
     "blocks.*.mlp.2": {"in_strategy": ((2, 1, 2), (1, 2)), "out_strategy": ((2, 1, 1),)}}

A strategy file is the same map in YAML, where entries may also be degree names (``dp``,
``mp``) filled in by ``load_strategy_file(path, dp=2, mp=2)``, so one file serves any world size.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Mapping
from typing import Any

from omegaconf import OmegaConf
from torch import nn


def _entry(pattern: str, value: Any) -> tuple[Any, Any]:
    if isinstance(value, Mapping):
        unknown = set(value) - {"in_strategy", "out_strategy"}
        if unknown or "in_strategy" not in value:
            raise ValueError(f"strategy for {pattern!r}: a mapping needs in_strategy (and may "
                             f"have out_strategy), got keys {sorted(value)}")
        return value["in_strategy"], value.get("out_strategy")
    return value, None


def match_strategies(model: nn.Module,
                     strategies: Mapping[str, Any]) -> dict[str, tuple[nn.Module, Any, Any]]:
    """Module path -> (module, in_strategy, out_strategy); every pattern must match something,
    and no module may match two patterns."""
    modules = dict(model.named_modules())
    chosen: dict[str, tuple[nn.Module, Any, Any]] = {}
    by_pattern: dict[str, str] = {}
    for pattern, value in strategies.items():
        hits = [p for p in modules if p and fnmatch.fnmatchcase(p, pattern)]
        if not hits:
            sample = ", ".join(p for p in list(modules)[1:12])
            raise ValueError(f"strategy pattern {pattern!r} matches no module of "
                             f"{type(model).__name__} (module paths look like: {sample}, ...)")
        in_strategy, out_strategy = _entry(pattern, value)
        for path in hits:
            if path in chosen:
                raise ValueError(f"module {path!r} matches strategy patterns "
                                 f"{by_pattern[path]!r} and {pattern!r}; give it one")
            chosen[path] = (modules[path], in_strategy, out_strategy)
            by_pattern[path] = pattern
    return chosen


def _fill(value: Any, degrees: Mapping[str, int], where: str) -> Any:
    if isinstance(value, str):
        if value not in degrees:
            raise ValueError(f"{where}: unknown degree name {value!r}; known names are "
                             f"{sorted(degrees)} (or write a number)")
        return degrees[value]
    if isinstance(value, list):
        return tuple(_fill(v, degrees, where) for v in value)
    if isinstance(value, Mapping):
        return {k: _fill(v, degrees, where) for k, v in value.items()}
    return value


def load_strategy_file(path: str | os.PathLike, **degrees: int) -> dict[str, Any]:
    """Read a YAML strategy map, replacing degree names with the numbers given."""
    data = OmegaConf.to_container(OmegaConf.load(os.fspath(path)), resolve=True)
    if not isinstance(data, Mapping) or not data:
        raise ValueError(f"strategy file {path}: expected a mapping of module-path patterns to "
                         f"strategies, got {type(data).__name__}")
    return {str(k): _fill(v, degrees, f"strategy file {path}, entry {k!r}")
            for k, v in data.items()}
