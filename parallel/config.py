"""``ParallelConfig``: the one definition of every parallel setting.

The degrees multiply to the world size: ``pipeline_degree × data_degree × expert_degree ×
context_degree × tensor_degree`` ranks (pp outermost, tp innermost: ``parallel.dims``).
``context_degree`` splits every sequence over its ranks (``parallel.context_parallel``); they
feed the same batch and are replicas for the gradient average. ``expert_degree`` shards
the experts of ``parallel.nn.MoE`` layers; the batch is split over ``data × expert`` ranks
(MindSpore's ``expert_parallel`` is a part of its ``data_parallel``), so the parameters outside
the experts are data-parallel over ``data × expert`` and each expert shard over ``data`` — inside
each pipeline stage, under optimizer parallel (sharded over those same ranks), and under
strategies (where the strategies' batch axis is the ``data × expert`` ranks and ``tensor`` their
operator split).

There is no mode: how each stage's operators are split follows from the fields
(:class:`OperatorSplit`). The reference's ``parallel_mode`` lives on only in the
``set_auto_parallel_context`` adapter, which translates it once (:func:`mode_fields`).

Everything else derives from this class: the Hydra schema of ``conf/parallel/``
(``recipes/config_schema.py`` builds it from :data:`FIELDS`), the MindSpore-style
``set_auto_parallel_context`` (an adapter that builds one with :meth:`ParallelConfig.from_context`)
and the matrix of combinations (``parallel.combinations``). Every choice is an enum, so the list
of allowed values lives in one place.

Every field is checked when the config is made (and again against the world size by
:meth:`resolve`), so a bad value is refused by name before any model changes. The names of the
previous release (``data``, ``model``/``model_parallel``, ``pipeline``, ``expert``) still work for
one release, with a ``DeprecationWarning``: each field declares its old names (``was``); so does
``mode=``, translated as the adapter translates it.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Mapping
from enum import Enum
from typing import Any

import torch

from parallel.choices import (
    ContextMethod,
    OperatorSplit,
    OptimizerLevel,
    ParallelMode,
    Schedule,
    SearchMode,
    operator_split,
)

# kept for the previous release's imports: the enums' values
SCHEDULES = tuple(s.value for s in Schedule)
SEARCH_MODES = tuple(s.value for s in SearchMode)
OPTIMIZER_LEVELS = tuple(level.value for level in OptimizerLevel)


def _field(default: Any, *, was: tuple[str, ...]) -> Any:
    """A field and its previous names: each still works for one release, with a
    ``DeprecationWarning`` — in ``ParallelConfig(...)`` and as an attribute (below), in
    ``set_auto_parallel_context`` and in the recipes' ``parallel`` group, which all read
    :data:`RENAMED`, made from these declarations."""
    return dataclasses.field(default=default, metadata={"was": was})


def _enum_value(enum: type[Enum], name: str, value: Any) -> Enum:
    try:
        return enum(value)
    except ValueError:
        raise ValueError(f"ParallelConfig.{name} {value!r} is not one of "
                         f"{[m.value for m in enum]}") from None


def _check_int(name: str, value: Any, low: int = 1, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"ParallelConfig.{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"ParallelConfig.{name} must be at least {low}, got {value}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"ParallelConfig.{name} must be a bool, got {type(value).__name__}")


def _check_memory(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not value > 0):  # "not >": NaN is refused too
        raise ValueError(f"ParallelConfig.{name} must be a positive number of bytes, got "
                         f"{value!r}")


def _check_mapping(name: str, value: Any) -> None:
    if not isinstance(value, Mapping):
        raise TypeError(f"ParallelConfig.{name} must be a mapping, got {type(value).__name__}")
    if name == "stages":
        for path, stage in value.items():
            if not isinstance(path, str):
                raise TypeError(f"ParallelConfig.stages keys are module paths, got {path!r}")
            _check_int(f"stages[{path!r}]", stage, low=0)


def _check_dtype(name: str, value: Any) -> None:
    if value not in (None, torch.float16, torch.bfloat16):
        raise ValueError(f"ParallelConfig.{name}={value}: a 16-bit dtype (torch.bfloat16 or "
                         f"torch.float16) for optimizer parallel, or None")


_ENUMS: dict[str, type[Enum]] = {"schedule": Schedule, "search_mode": SearchMode,
                                 "optimizer_level": OptimizerLevel,
                                 "context_method": ContextMethod}


def check_field(name: str, value: Any) -> Any:
    """``value`` of field ``name`` in its stored form (enums for choices), or TypeError /
    ValueError naming the field and its rule. The one per-field check, shared by the config and
    the ``set_auto_parallel_context`` adapter."""
    if name == "search_mode" and value is None:  # no search
        return None
    if name in _ENUMS:
        if not isinstance(value, str):  # the enums are str too
            raise TypeError(f"ParallelConfig.{name} must be a {_ENUMS[name].__name__} or str, "
                            f"got {type(value).__name__}")
        return _enum_value(_ENUMS[name], name, value)
    if name == "data_degree":
        _check_int(name, value, allow_none=True)
    elif name in ("tensor_degree", "pipeline_degree", "expert_degree", "context_degree",
                  "micro_batches", "virtual_stages", "multi_copy"):
        _check_int(name, value)
    elif name == "parallel_optimizer_threshold":
        _check_int(name, value, low=0)
    elif name == "optimizer_weight_shard_size":
        _check_int(name, value, low=2, allow_none=True)
    elif name in ("full_batch", "gradients_mean", "parameter_broadcast",
                  "enable_parallel_optimizer", "offload_params", "strict_nodes"):
        _check_bool(name, value)
    elif name == "strategy_tags":
        if value is not None:
            _check_bool(name, value)
    elif name == "max_device_memory":
        _check_memory(name, value)
    elif name in ("stages", "strategies"):
        _check_mapping(name, value)
        return dict(value)
    elif name == "param_dtype":
        _check_dtype(name, value)
    else:
        raise ValueError(f"unknown ParallelConfig field {name!r}; the fields are {FIELDS}")
    return value


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How to spread a model over the job's ranks (see the module docstring).

    There is no mode: the degrees and the optimizer level give the layout, and how each stage's
    operators are split follows from the strategies, the search and ``tensor_degree``
    (:func:`operator_split`, :attr:`operator_split`): searched when ``search_mode`` is set
    (auto parallel), by ``strategies`` or ``parallel.shard`` tags when there are some (semi-auto),
    by the model's own collectives when ``tensor_degree > 1`` asks for a split neither gives
    (hybrid), else not at all (data parallel).

    data_degree, tensor_degree, pipeline_degree, expert_degree: degrees; ``data_degree=None``
        takes what the others leave of the world. ``expert_degree`` must divide every MoE
        layer's ``num_experts``.
    context_degree: ranks each sequence is split over (``parallel.context_parallel``): each
        holds ``1/context_degree`` of every activation's tokens, in balanced head-tail chunks;
        context_method: a :class:`ContextMethod`, how attention sees the whole sequence.
    micro_batches: micro-batches per step (pipeline); schedule: a :class:`Schedule`;
    virtual_stages: stages per rank for ``interleaved_1f1b`` (``zbv`` always has 2).
    stages: module path -> stage index, merged with ``parallel.pipeline_stage`` tags.
    full_batch: True: every rank of a stage feeds the whole batch; False: each data rank feeds
        its own slice (MindSpore's dataset strategy). Only a split by strategies (given or
        searched) can run with True: the others always split the batch.
    strategies: module-path pattern -> semi-auto strategy (with ``search_mode``: annotations).
    strategy_tags: whether the model carries ``parallel.shard`` tags, which split its operators
        by strategies even without ``strategies``; None: not known yet (``parallelize`` sets it
        from the model, and checks the config again).
    gradients_mean, parameter_broadcast: data parallel's gradient mean and rank-0 broadcast.
    search_mode: a :class:`SearchMode` searches the strategies (auto parallel; None: no search);
        max_device_memory: the modelled bytes per device its plan may hold (the two searches;
        None: no limit).
    enable_parallel_optimizer, optimizer_level, optimizer_weight_shard_size,
    parallel_optimizer_threshold: optimizer parallel (``parallel.optimizer_parallel``): the
        :class:`OptimizerLevel`; how many data ranks share one shard (None: all of them; the
        rest replicate); parameters under this many KB stay replicated.
    param_dtype: optimizer parallel — hold the parameters in ``torch.bfloat16``/``float16``,
        keeping their FP32 values for an offloading optimizer's masters (ZeRO-Offload).
    offload_params: optimizer parallel level2/3 — each rank's shards of the weights and
        gradients rest in host memory and visit the device a layer at a time (ZeRO-Infinity's
        ``offload_param``, FSDP2's ``CPUOffloadPolicy``); build the optimizer on the host.
        Without optimizer parallel (or at level1, whose weights are whole),
        ``hetero.offload.apply_offload`` offloads them.
    multi_copy: split each batch into this many copies whose communication overlaps another
        copy's compute (``parallel.multi_copy``; MindSpore's ``MicroBatchInterleaved``).
    strict_nodes: refuse (instead of warning about) a layout whose tensor or expert groups
        span nodes (``parallel.nodes``: torchrun's ``LOCAL_WORLD_SIZE`` ranks per node).
    """

    data_degree: int | None = _field(None, was=("data",))
    tensor_degree: int = _field(1, was=("model", "model_parallel"))
    pipeline_degree: int = _field(1, was=("pipeline",))
    expert_degree: int = _field(1, was=("expert",))
    context_degree: int = 1
    context_method: ContextMethod = ContextMethod.RING
    micro_batches: int = 1
    schedule: Schedule = Schedule.ONE_F_ONE_B
    virtual_stages: int = 2
    stages: Mapping[str, int] = dataclasses.field(default_factory=dict)
    full_batch: bool = True
    strategies: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    strategy_tags: bool | None = None
    gradients_mean: bool = True
    parameter_broadcast: bool = True
    search_mode: SearchMode | None = None
    enable_parallel_optimizer: bool = False
    optimizer_level: OptimizerLevel = OptimizerLevel.LEVEL1
    optimizer_weight_shard_size: int | None = None
    parallel_optimizer_threshold: int = 64
    param_dtype: Any = None
    offload_params: bool = False
    multi_copy: int = 1
    max_device_memory: float | None = None
    strict_nodes: bool = False

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, check_field(f.name, getattr(self, f.name)))
        from parallel.combinations import check_combination  # the matrix needs the enums above

        check_combination(self)

    # ------------------------------------------------------------------ derived
    def resolve(self, world_size: int) -> ParallelConfig:
        """This config with ``data_degree`` filled in for ``world_size`` ranks; ValueError
        naming the degrees when they do not multiply to the world."""
        others = (self.pipeline_degree * self.tensor_degree * self.expert_degree
                  * self.context_degree)
        context = f" × context_degree={self.context_degree}" if self.context_degree > 1 else ""
        data = self.data_degree
        if data is None:
            if world_size % others:
                raise ValueError(f"ParallelConfig: pipeline_degree={self.pipeline_degree} × "
                                 f"tensor_degree={self.tensor_degree} × expert_degree="
                                 f"{self.expert_degree}{context} = {others} does not divide "
                                 f"the world size {world_size}")
            data = world_size // others
        if data * others != world_size:
            raise ValueError(f"ParallelConfig: pipeline_degree={self.pipeline_degree} × "
                             f"data_degree={data} × tensor_degree={self.tensor_degree} × "
                             f"expert_degree={self.expert_degree}{context} = "
                             f"{data * others}, but the job has {world_size} ranks")
        resolved = dataclasses.replace(self, data_degree=data)
        from parallel.combinations import check_resolved

        check_resolved(resolved)
        return resolved

    def _resolved(self, what: str) -> int:
        if self.data_degree is None:
            raise ValueError(f"ParallelConfig.{what} needs data_degree: call "
                             f"resolve(world_size) first")
        return self.data_degree

    @property
    def optimizer_shard_size(self) -> int:
        """Ranks sharing one optimizer shard (``optimizer_weight_shard_size`` or all of the
        data ranks); needs :meth:`resolve` first."""
        return self.optimizer_weight_shard_size or self._resolved("optimizer_shard_size")

    @property
    def batch_ranks(self) -> int:
        """Ranks splitting the batch (``data × expert``); needs :meth:`resolve` first."""
        return self._resolved("batch_ranks") * self.expert_degree

    @property
    def replica_ranks(self) -> int:
        """Ranks averaging the gradients of replicated parameters (``data × expert ×
        context``: context ranks hold replicas fed other tokens); needs :meth:`resolve`."""
        return self.batch_ranks * self.context_degree

    @property
    def stage_ranks(self) -> int:
        """Ranks per pipeline stage (``data × expert × context × tensor``); needs
        :meth:`resolve`."""
        return (self._resolved("stage_ranks") * self.expert_degree * self.context_degree
                * self.tensor_degree)

    @property
    def operator_split(self) -> OperatorSplit:
        """How each stage's operators are split (:func:`operator_split`)."""
        return operator_split(self)

    @property
    def shards_operators(self) -> bool:
        """Whether operators are split by DTensor strategies, given or searched."""
        return self.operator_split in (OperatorSplit.STRATEGIES, OperatorSplit.SEARCH)

    @property
    def mode(self) -> ParallelMode:
        """Deprecated: the reference's mode this config runs as (:attr:`operator_split`)."""
        warnings.warn("ParallelConfig.mode is deprecated: the degrees, strategies and "
                      "search_mode say it; read ParallelConfig.operator_split",
                      DeprecationWarning, stacklevel=2)
        return self.operator_split.reference_mode

    @classmethod
    def from_context(cls, **overrides: Any) -> ParallelConfig:
        """The ``set_auto_parallel_context`` settings as a config (``overrides`` win)."""
        from parallel.context import context_fields

        return cls(**{**context_fields(), **overrides})


FIELDS = tuple(f.name for f in dataclasses.fields(ParallelConfig))
#: a previous name -> its field (one name per dimension: the fields declare the old ones)
RENAMED = {old: f.name for f in dataclasses.fields(ParallelConfig)
           for old in f.metadata.get("was", ())}


def _renamed(kwargs: dict[str, Any], where: str) -> dict[str, Any]:
    """``kwargs`` with the previous release's names replaced (DeprecationWarning each)."""
    for old, new in RENAMED.items():
        if old in kwargs:
            if new in kwargs:
                raise ValueError(f"{where}: {old!r} is the old name of {new!r}; give one")
            warnings.warn(f"{where}: {old!r} is deprecated, use {new!r}", DeprecationWarning,
                          stacklevel=3)
            kwargs[new] = kwargs.pop(old)
    return kwargs


def mode_fields(mode: Any, given: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The fields that say what the reference's ``mode`` said, beside the fields ``given`` with
    it: ``stand_alone`` is one replica (``data_degree=1``), ``auto_parallel`` a search
    (``search_mode``, sharding propagation unless given), ``semi_auto_parallel`` a model whose
    operators carry strategies (``strategy_tags=True``, until ``parallelize`` sees the model);
    the other modes follow from the degrees. Only an ``auto_parallel`` searches."""
    try:
        mode = ParallelMode(mode)
    except ValueError:
        raise ValueError(f"{where}: mode {mode!r} is not one of "
                         f"{[m.value for m in ParallelMode]}") from None
    fields: dict[str, Any] = {"search_mode": None}
    if mode is ParallelMode.AUTO_PARALLEL:
        fields["search_mode"] = given.get("search_mode") or SearchMode.SHARDING_PROPAGATION
    if mode is ParallelMode.SEMI_AUTO_PARALLEL:
        fields["strategy_tags"] = True
    if mode is ParallelMode.STAND_ALONE:
        if (given.get("data_degree") or 1) > 1:
            raise ValueError(f"{where}: mode 'stand_alone' keeps one copy per rank, but "
                             f"data_degree={given['data_degree']} ranks would each train their "
                             f"own; drop the mode")
        fields["data_degree"] = 1
    return fields


def _accept_old_names(init: Any) -> Any:
    @functools.wraps(init)
    def __init__(self: ParallelConfig, *args: Any, **kwargs: Any) -> None:
        kwargs = _renamed(kwargs, "ParallelConfig")
        if "mode" in kwargs:
            mode = kwargs.pop("mode")
            warnings.warn("ParallelConfig(mode=...) is deprecated: the degrees, strategies and "
                          "search_mode say it (auto_parallel is search_mode=..., stand_alone "
                          "data_degree=1; the others need nothing)", DeprecationWarning,
                          stacklevel=2)
            kwargs.update(mode_fields(mode, kwargs, "ParallelConfig"))
        init(self, *args, **kwargs)
    return __init__


ParallelConfig.__init__ = _accept_old_names(ParallelConfig.__init__)  # type: ignore[method-assign]


def _old_attribute(old: str, new: str) -> property:
    def read(self: ParallelConfig) -> Any:
        warnings.warn(f"ParallelConfig.{old} is deprecated, use ParallelConfig.{new}",
                      DeprecationWarning, stacklevel=2)
        return getattr(self, new)
    return property(read, doc=f"Deprecated: ``{new}``.")


for _old, _new in RENAMED.items():
    setattr(ParallelConfig, _old, _old_attribute(_old, _new))
