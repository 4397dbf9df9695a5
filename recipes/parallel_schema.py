"""The ``parallel`` config group's schema, derived from ``parallel.ParallelConfig``.

Not a second copy: every field of ``ParallelConfig`` (under its own name) becomes a field here,
typed for OmegaConf, and its value is checked by ``ParallelConfig`` itself (``cross_check`` runs
before any work starts). Choices stay in ``parallel.config``'s enums, typed as strings checked
against the enum's values (``schedule: zbv``), since those are what users type.

What only a recipe needs sits beside them: ``name`` (the group's option), ``strategy`` (a strategy
file, which becomes ``ParallelConfig.strategies``) and ``tensor_degree: null`` (the ranks the
other degrees leave in a pipeline stage, for semi_auto). The previous release's names, which
``ParallelConfig``'s fields declare (``model_parallel``, ``pipeline``, ``expert``, ...), and
``mode`` (``AUTO_PARALLEL`` is a ``search_mode``, ``STAND_ALONE`` ``data_degree: 1``; the strategy
file and the degrees say the rest), still work for one release, with a ``DeprecationWarning``
(``recipes/parallel_mode.py``).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Optional

from omegaconf import MISSING, DictConfig

from parallel.config import FIELDS, RENAMED, ParallelConfig, ParallelMode, SearchMode
from recipes.config_rules import rule

#: ParallelConfig fields the recipe fills from elsewhere: the strategy file, offload.param_dtype,
#: offload.params (the offload group says where weights rest); the recipes' models carry no
#: parallel.shard tags
FROM_ELSEWHERE = ("strategies", "param_dtype", "offload_params", "strategy_tags")
#: the previous release's keys of the group -> this release's: the fields' own declarations
DEPRECATED_KEYS = RENAMED

_TYPES: dict[str, Any] = {"int": int, "bool": bool, "int | None": Optional[int],  # noqa: UP045
                          "float | None": Optional[float],  # noqa: UP045
                          "Mapping[str, int]": dict[str, int]}


def _field(f: dataclasses.Field) -> tuple[str, Any, Any]:
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if f.name == "search_mode":  # null: no search
        return f.name, Optional[str], rule(None, choices=[m.value for m in SearchMode])  # noqa: UP045
    if isinstance(default, enum.Enum):  # a choice users type by value: checked as the enum's
        return f.name, str, rule(default.value, choices=[m.value for m in type(default)])
    if f.name == "tensor_degree":  # null: the rest of a pipeline stage (semi_auto)
        return f.name, Optional[int], dataclasses.field(default=None)  # noqa: UP045
    kind = _TYPES[str(f.type)]
    if isinstance(default, dict):
        return f.name, kind, dataclasses.field(default_factory=dict)
    return f.name, kind, dataclasses.field(default=default)


def _cross_check(cfg: DictConfig) -> list[str]:
    """ParallelConfig's own per-field checks, so a bad value fails before any work starts."""
    from recipes.parallel_mode import config_fields

    fields = config_fields(cfg)
    if cfg.get("strategy") and not fields.get("search_mode"):
        fields["strategy_tags"] = True  # the strategy file (read later) splits the operators
    try:
        ParallelConfig(**fields)
    except (TypeError, ValueError) as err:
        return [str(err).replace("ParallelConfig.", "")]
    return []


ParallelGroupConfig = dataclasses.make_dataclass(
    "ParallelGroupConfig",
    [("name", str, dataclasses.field(default=MISSING)),
     # a strategy file (a name in conf/strategy/ or a YAML path) mapping module paths to shard
     # strategies; its "mp"/"dp" entries are filled in from tensor_degree and data_degree
     ("strategy", Optional[str], dataclasses.field(default=None)),  # noqa: UP045
     *(_field(f) for f in dataclasses.fields(ParallelConfig) if f.name not in FROM_ELSEWHERE),
     *((old, Optional[int], dataclasses.field(default=None))  # noqa: UP045
       for old in DEPRECATED_KEYS),
     # the previous release's mode (DATA_PARALLEL, ...): parallel.config.mode_fields
     ("mode", Optional[ParallelMode], dataclasses.field(default=None))],  # noqa: UP045
    namespace={"cross_check": staticmethod(_cross_check),
               "__doc__": "The parallel group: ParallelConfig's fields (see the module doc)."},
)

assert {f.name for f in dataclasses.fields(ParallelGroupConfig)} >= set(FIELDS) - set(
    FROM_ELSEWHERE), "the schema lost a ParallelConfig field"
