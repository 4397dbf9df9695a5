"""``ParallelConfig``: one typed, explicit description of how a job is parallelised.

The degrees multiply to the world size: ``pipeline × data × expert × model`` ranks. ``expert``
shards the experts of ``parallel.nn.MoE`` layers; the batch is split over ``data × expert`` ranks
(MindSpore's ``expert_parallel`` is a part of its ``data_parallel``), so the parameters outside
the experts are data-parallel over ``data × expert`` and each expert shard over ``data`` — inside
each pipeline stage, under optimizer parallel (sharded over those same ranks), and in semi-auto
mode (where the strategies' batch axis is the ``data × expert`` ranks and ``model`` their
operator split).

``parallel.parallelize(model, config)`` reads nothing else: the MindSpore-style
``set_auto_parallel_context`` is only a front door that :meth:`ParallelConfig.from_context`
converts, and no mode writes the context back.

Every field is checked when the config is made (and again against the world size by
:meth:`resolve`), so a bad value is refused by name before any model changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from parallel.context import SEARCH_MODES, ParallelMode, get_auto_parallel_context, is_explicit

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv")
OPTIMIZER_LEVELS = ("level1", "level2", "level3")


def _check_int(name: str, value: Any, low: int = 1, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"ParallelConfig.{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"ParallelConfig.{name} must be at least {low}, got {value}")


def _check_optimizer_shards(data: int, shard_size: int | None) -> None:
    if data == 1:
        raise ValueError("ParallelConfig.enable_parallel_optimizer=True shards over data-parallel "
                         "replicas, but data=1: there is no replica to share the optimizer with")
    if shard_size is not None and (shard_size > data or data % shard_size):
        raise ValueError(f"ParallelConfig.optimizer_weight_shard_size={shard_size} must divide "
                         f"the data-parallel degree {data} (ranks sharing a shard; the groups "
                         f"replicate)")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How to spread a model over the job's ranks (see the module docstring).

    mode: what shards each stage's operators — ``stand_alone`` / ``data_parallel`` (none: the
        ``data`` ranks hold replicas) or ``semi_auto_parallel`` (``strategies`` over the
        ``data × expert × model`` ranks of a stage; the strategies' batch axis is the data
        (× expert) parallelism).
    data, pipeline, model, expert: degrees; ``data=None`` takes what the others leave of the world.
        ``expert`` must divide every MoE layer's ``num_experts``.
    micro_batches: micro-batches per step (pipeline); schedule: one of ``SCHEDULES``;
    virtual_stages: stages per rank for ``interleaved_1f1b`` (``zbv`` always has 2).
    stages: module path -> stage index, merged with ``parallel.pipeline_stage`` tags.
    full_batch: semi-auto only — True: every rank feeds the whole batch; False: each data-parallel
        rank feeds its own slice (MindSpore's dataset strategy).
    strategies: semi-auto module-path -> strategy map (``parallel.parallelize(strategies=...)``).
    enable_parallel_optimizer, optimizer_level, optimizer_weight_shard_size,
    parallel_optimizer_threshold: optimizer parallel (``parallel.optimizer_parallel``): the
        level; how many ``data`` ranks share one shard (None: all of them; the rest replicate);
        parameters under this many KB stay replicated.
    param_dtype: optimizer parallel — hold the parameters in ``torch.bfloat16``/``float16``,
        keeping their FP32 values for an offloading optimizer's masters (ZeRO-Offload).
    multi_copy: split each batch into this many copies whose communication overlaps another
        copy's compute (``parallel.multi_copy``; MindSpore's ``MicroBatchInterleaved``).
    search_mode, max_device_memory: auto_parallel — the search, and the modelled bytes per
        device its plan may hold (the two searches; None: no limit). With optimizer parallel,
        auto_parallel keeps the ``data`` ranks as a data axis (the batch split over them, every
        parameter replicated there) and splits parameters over at most ``model`` ranks.
    """

    mode: ParallelMode | str = ParallelMode.DATA_PARALLEL
    data: int | None = None
    pipeline: int = 1
    model: int = 1
    expert: int = 1
    micro_batches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 2
    stages: Mapping[str, int] = dataclasses.field(default_factory=dict)
    full_batch: bool = True
    strategies: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    gradients_mean: bool = True
    parameter_broadcast: bool = True
    search_mode: str = "sharding_propagation"
    enable_parallel_optimizer: bool = False
    optimizer_level: str = "level1"
    optimizer_weight_shard_size: int | None = None
    parallel_optimizer_threshold: int = 64
    param_dtype: Any = None
    multi_copy: int = 1
    max_device_memory: float | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "mode", ParallelMode(self.mode))
        except ValueError:
            raise ValueError(f"ParallelConfig.mode {self.mode!r} is not one of "
                             f"{[m.value for m in ParallelMode]}") from None
        _check_int("data", self.data, allow_none=True)
        for name in ("pipeline", "model", "expert", "micro_batches", "virtual_stages",
                     "multi_copy"):
            _check_int(name, getattr(self, name))
        _check_int("parallel_optimizer_threshold", self.parallel_optimizer_threshold, low=0)
        _check_int("optimizer_weight_shard_size", self.optimizer_weight_shard_size,
                   allow_none=True)
        for name in ("full_batch", "gradients_mean", "parameter_broadcast",
                     "enable_parallel_optimizer"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ParallelConfig.{name} must be a bool, got "
                                f"{type(getattr(self, name)).__name__}")
        for name, allowed in (("schedule", SCHEDULES), ("search_mode", SEARCH_MODES),
                              ("optimizer_level", OPTIMIZER_LEVELS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"ParallelConfig.{name} {getattr(self, name)!r} is not one of "
                                 f"{allowed}")
        if self.schedule == "zbv" and self.virtual_stages != 2:
            raise ValueError(f"ParallelConfig.virtual_stages={self.virtual_stages}: the zbv "
                             f"schedule places exactly 2 stages per rank (a V)")
        for path, stage in dict(self.stages).items():
            if not isinstance(path, str):
                raise TypeError(f"ParallelConfig.stages keys are module paths, got {path!r}")
            _check_int(f"stages[{path!r}]", stage, low=0)
        object.__setattr__(self, "stages", dict(self.stages))
        object.__setattr__(self, "strategies", dict(self.strategies))
        if (self.schedule == "zbv" and self.pipeline > 1
                and self.mode in (ParallelMode.SEMI_AUTO_PARALLEL, ParallelMode.AUTO_PARALLEL)):
            raise ValueError("ParallelConfig.schedule='zbv' splits backward into input and weight "
                             "passes, which torch's pipelining cannot run through semi-auto's "
                             "DTensor parameters; use '1f1b' or 'interleaved_1f1b'")
        if self.mode is ParallelMode.AUTO_PARALLEL:
            self._check_auto()
        if self.model > 1 and self.mode not in (ParallelMode.SEMI_AUTO_PARALLEL,
                                                ParallelMode.AUTO_PARALLEL):
            raise ValueError(f"ParallelConfig.model={self.model} shards operators, which needs "
                             f"mode='semi_auto_parallel' (got {self.mode.value!r})")
        if self.strategies and self.mode not in (ParallelMode.SEMI_AUTO_PARALLEL,
                                                 ParallelMode.AUTO_PARALLEL):
            raise ValueError(f"ParallelConfig.strategies apply to mode='semi_auto_parallel' "
                             f"(or are auto_parallel's annotations), not {self.mode.value!r}")
        if not self.full_batch and self.mode is not ParallelMode.SEMI_AUTO_PARALLEL:
            raise ValueError("ParallelConfig.full_batch=False is semi-auto's dataset strategy; "
                             f"mode {self.mode.value!r} always feeds each data rank its slice")
        if self.enable_parallel_optimizer and self.mode not in (
                ParallelMode.DATA_PARALLEL, ParallelMode.SEMI_AUTO_PARALLEL,
                ParallelMode.AUTO_PARALLEL):
            raise ValueError(f"ParallelConfig.enable_parallel_optimizer=True shards the "
                             f"optimizer over data-parallel replicas, which needs "
                             f"mode='data_parallel', 'semi_auto_parallel' or 'auto_parallel' "
                             f"(got {self.mode.value!r})")
        if (self.enable_parallel_optimizer and self.param_dtype is not None
                and self.mode in (ParallelMode.SEMI_AUTO_PARALLEL, ParallelMode.AUTO_PARALLEL)):
            raise ValueError(f"ParallelConfig.param_dtype with {self.mode.value} optimizer "
                             f"parallel is not built yet")
        if self.max_device_memory is not None and (
                self.mode is not ParallelMode.AUTO_PARALLEL
                or self.search_mode == "sharding_propagation"):
            raise ValueError("ParallelConfig.max_device_memory bounds the plan of "
                             "mode='auto_parallel' with search_mode 'dynamic_programming' or "
                             "'recursive_programming'")
        if self.max_device_memory is not None and (
                isinstance(self.max_device_memory, bool)
                or not isinstance(self.max_device_memory, (int, float))
                or self.max_device_memory <= 0):
            raise ValueError(f"ParallelConfig.max_device_memory must be a positive number of "
                             f"bytes, got {self.max_device_memory!r}")
        if self.param_dtype is not None and (
                not self.enable_parallel_optimizer
                or self.param_dtype not in (torch.float16, torch.bfloat16)):
            raise ValueError(f"ParallelConfig.param_dtype={self.param_dtype}: a 16-bit dtype "
                             f"(torch.bfloat16 or torch.float16) for optimizer parallel "
                             f"(enable_parallel_optimizer=True), or None")
        if self.optimizer_weight_shard_size == 1:
            raise ValueError("ParallelConfig.optimizer_weight_shard_size=1 would not shard "
                             "anything; use at least 2, or None for the whole data dimension")
        self._refuse_unbuilt()

    def _check_auto(self) -> None:
        """auto_parallel plans over a stage's ranks itself: no model degree unless optimizer
        parallel asks for a data axis, the whole batch on every rank, and only what is built."""
        if self.model > 1 and not self.enable_parallel_optimizer:
            raise ValueError(f"ParallelConfig.model={self.model}: auto_parallel chooses how to "
                             f"split each operator over the stage's ranks; leave model=1 (with "
                             f"enable_parallel_optimizer, model bounds the ranks a parameter "
                             f"may be split over, the other data ranks holding replicas)")
        if not self.full_batch:
            raise ValueError("ParallelConfig.full_batch=False with auto_parallel is not built "
                             "yet: every rank feeds the whole batch")
        for name in ("expert", "multi_copy"):
            if getattr(self, name) != 1:
                raise ValueError(f"ParallelConfig.mode='auto_parallel' with {name}="
                                 f"{getattr(self, name)} is not built yet")

    def _refuse_unbuilt(self) -> None:
        """Combinations whose mode is not built yet are refused by name, not half-run."""
        if (self.enable_parallel_optimizer and self.pipeline > 1
                and self.schedule not in ("gpipe", "1f1b")):
            raise ValueError(f"ParallelConfig.enable_parallel_optimizer with schedule "
                             f"{self.schedule!r} (several stages per rank) is not built yet; "
                             f"use 'gpipe' or '1f1b'")
        if self.expert > 1 and self.mode is ParallelMode.STAND_ALONE:
            raise ValueError(f"ParallelConfig.expert={self.expert} splits the batch over data × "
                             f"expert ranks, which mode='stand_alone' (one copy per rank, "
                             f"no collectives) cannot do; use mode='data_parallel'")
        if self.expert > 1 and self.mode is ParallelMode.SEMI_AUTO_PARALLEL and (
                self.pipeline > 1 or self.enable_parallel_optimizer or self.multi_copy > 1):
            raise ValueError(f"ParallelConfig.expert={self.expert} with mode "
                             f"'semi_auto_parallel' together with pipeline, optimizer parallel "
                             f"or multi_copy is not built yet")
        if self.expert > 1 and self.enable_parallel_optimizer and (
                self.optimizer_weight_shard_size is not None or self.param_dtype is not None):
            raise ValueError(f"ParallelConfig.expert={self.expert} with optimizer parallel's "
                             f"optimizer_weight_shard_size or param_dtype is not built yet")
        if self.multi_copy > 1 and self.enable_parallel_optimizer:
            raise ValueError(f"ParallelConfig.multi_copy={self.multi_copy} with "
                             f"enable_parallel_optimizer is not built yet")
        if self.multi_copy > 1 and self.pipeline > 1:
            raise ValueError(f"ParallelConfig.multi_copy={self.multi_copy} with pipeline="
                             f"{self.pipeline} is not built yet: pipeline micro-batches already "
                             f"overlap one stage's communication with another's compute")
        if self.mode is ParallelMode.HYBRID_PARALLEL:
            raise ValueError(f"ParallelConfig.mode {self.mode.value!r} is not built yet; built "
                             f"modes: stand_alone, data_parallel, semi_auto_parallel (each "
                             f"combinable with pipeline=P), auto_parallel")

    # ------------------------------------------------------------------ derived
    def resolve(self, world_size: int) -> ParallelConfig:
        """This config with ``data`` filled in for ``world_size`` ranks; ValueError naming the
        degrees when they do not multiply to the world."""
        others = self.pipeline * self.model * self.expert
        data = self.data
        if data is None:
            if world_size % others:
                raise ValueError(f"ParallelConfig: pipeline={self.pipeline} × model={self.model} "
                                 f"× expert={self.expert} = {others} does not divide the world "
                                 f"size {world_size}")
            data = world_size // others
        if data * others != world_size:
            raise ValueError(f"ParallelConfig: pipeline={self.pipeline} × data={data} × "
                             f"model={self.model} × expert={self.expert} = {data * others}, but "
                             f"the job has {world_size} ranks")
        if self.mode is ParallelMode.STAND_ALONE and data > 1:
            raise ValueError(f"ParallelConfig.mode='stand_alone' keeps one copy per rank, but "
                             f"data={data} ranks would each train their own; use "
                             f"mode='data_parallel'")
        if self.enable_parallel_optimizer:
            _check_optimizer_shards(data * self.expert, self.optimizer_weight_shard_size)
        return dataclasses.replace(self, data=data)

    @property
    def optimizer_shard_size(self) -> int:
        """Ranks sharing one optimizer shard (``optimizer_weight_shard_size`` or all of
        ``data``); needs :meth:`resolve` first."""
        if self.data is None:
            raise ValueError("ParallelConfig.data is not resolved yet: call resolve(world_size)")
        return self.optimizer_weight_shard_size or self.data

    @property
    def batch_ranks(self) -> int:
        """Ranks splitting the batch (``data × expert``); needs :meth:`resolve` first."""
        if self.data is None:
            raise ValueError("ParallelConfig.data is not resolved yet: call resolve(world_size)")
        return self.data * self.expert

    @property
    def stage_ranks(self) -> int:
        """Ranks per pipeline stage (``data × expert × model``); needs :meth:`resolve` first."""
        if self.data is None:
            raise ValueError("ParallelConfig.data is not resolved yet: call resolve(world_size)")
        return self.data * self.expert * self.model

    @classmethod
    def from_context(cls, **overrides: Any) -> ParallelConfig:
        """The ``set_auto_parallel_context`` settings as a config (``overrides`` win)."""
        mode = get_auto_parallel_context("parallel_mode")
        fields = {
            "mode": mode,
            "pipeline": get_auto_parallel_context("pipeline_stages"),
            # semi-auto fed every rank the whole batch before full_batch was read: keep that
            # unless the user set full_batch
            "full_batch": (get_auto_parallel_context("full_batch")
                           if mode is ParallelMode.SEMI_AUTO_PARALLEL and is_explicit("full_batch")
                           else True),
            "gradients_mean": get_auto_parallel_context("gradients_mean"),
            "parameter_broadcast": get_auto_parallel_context("parameter_broadcast"),
            **({"search_mode": get_auto_parallel_context("search_mode")}
               if is_explicit("search_mode") else {}),
            "enable_parallel_optimizer": get_auto_parallel_context("enable_parallel_optimizer"),
            **get_auto_parallel_context("parallel_optimizer_config"),
        }
        fields.update(overrides)
        return cls(**fields)
