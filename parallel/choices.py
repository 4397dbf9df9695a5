"""The choices a ``ParallelConfig`` makes among named values: pipeline schedules, searches,
optimizer levels, context methods, and the operator split its fields imply (with the reference's
five modes it stands for). Each is a ``str`` enum that prints as its value, so the list of
allowed values lives in one place (``parallel.config`` checks fields against them, the recipes'
schema lists them)."""

from __future__ import annotations

from enum import Enum
from typing import Any


class ParallelMode(str, Enum):
    """The reference's five modes: MindSpore's ``parallel_mode``. Only the context adapter
    (``parallel.context``) takes one; it is translated there, once, into the fields that say the
    same (:func:`mode_fields`): ``ParallelConfig`` has no mode, the degrees, the strategies and
    the search say it (:class:`OperatorSplit`)."""

    STAND_ALONE = "stand_alone"
    DATA_PARALLEL = "data_parallel"
    SEMI_AUTO_PARALLEL = "semi_auto_parallel"
    AUTO_PARALLEL = "auto_parallel"
    HYBRID_PARALLEL = "hybrid_parallel"


class _Choice(str, Enum):
    """A choice that prints as its value (``f"{schedule}"`` -> ``1f1b``), as the plain strings
    of the previous release did."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __repr__(self) -> str:
        return repr(self.value)


class Schedule(_Choice):
    """Pipeline schedules (``torch.distributed.pipelining``)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"
    ZERO_BUBBLE_V = "zbv"

    @property
    def stages_per_rank_fixed(self) -> bool:
        """One stage per rank (gpipe, 1f1b) rather than several (interleaved, zbv)."""
        return self in (Schedule.GPIPE, Schedule.ONE_F_ONE_B)


class SearchMode(_Choice):
    """auto_parallel's strategy searches (``parallel.auto``)."""

    SHARDING_PROPAGATION = "sharding_propagation"
    DYNAMIC_PROGRAMMING = "dynamic_programming"
    RECURSIVE_PROGRAMMING = "recursive_programming"


class OptimizerLevel(_Choice):
    """MindSpore's optimizer-parallel levels: state, + gradients, + weights sharded."""

    LEVEL1 = "level1"
    LEVEL2 = "level2"
    LEVEL3 = "level3"


class ContextMethod(_Choice):
    """How attention runs over a sequence split by ``context_degree``
    (``parallel.context_parallel``): ring attention passes keys and values around the ranks;
    Ulysses trades the sequence split for a head split with all-to-alls."""

    RING = "ring"
    ULYSSES = "ulysses"


class OperatorSplit(_Choice):
    """How a pipeline stage's operators are split over its ranks. Derived, never set
    (:func:`operator_split`): the strategies, the search and the degrees say it.

    ``replicas``: not split, the ranks hold replicas (the reference's ``data_parallel``);
    ``strategies``: by the given strategies, ``ParallelConfig.strategies`` or ``parallel.shard``
    tags (``semi_auto_parallel``); ``search``: by strategies searched with ``search_mode``
    (``auto_parallel``, the given ones as annotations); ``model``: by the model's own
    tensor-parallel collectives over ``tensor_degree`` ranks (``hybrid_parallel``; its split
    parameters marked with ``parallel.mark_model_parallel``)."""

    REPLICAS = "replicas"
    STRATEGIES = "strategies"
    SEARCH = "search"
    MODEL = "model"

    @property
    def reference_mode(self) -> ParallelMode:
        """The reference's mode that runs the same way."""
        return _REFERENCE_MODES[self]


_REFERENCE_MODES = {OperatorSplit.REPLICAS: ParallelMode.DATA_PARALLEL,
                    OperatorSplit.STRATEGIES: ParallelMode.SEMI_AUTO_PARALLEL,
                    OperatorSplit.SEARCH: ParallelMode.AUTO_PARALLEL,
                    OperatorSplit.MODEL: ParallelMode.HYBRID_PARALLEL}


def operator_split(config: Any) -> OperatorSplit:
    """How ``config`` (a ``ParallelConfig``, or any object with its fields) splits each stage's
    operators: searched when it has a ``search_mode``, by strategies when it has some (or the
    model carries ``parallel.shard`` tags: ``parallelize`` records that), by the model's own
    collectives when ``tensor_degree > 1`` asks for a split none of those gives, else not."""
    if config.search_mode is not None:
        return OperatorSplit.SEARCH
    if config.strategies or getattr(config, "strategy_tags", False):
        return OperatorSplit.STRATEGIES
    if config.tensor_degree > 1:
        return OperatorSplit.MODEL
    return OperatorSplit.REPLICAS
