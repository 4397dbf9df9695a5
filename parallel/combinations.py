"""Which parallel features combine: the single source of the combination matrix.

A config switches on *features* (:data:`FEATURES`: pipeline stages, tensor sharding, experts,
optimizer parallel, ...). Every pair of features is built unless a :class:`Rule` below says
otherwise, and a rule says why: ``MEANINGLESS`` (the two contradict each other, so no code could
build them) or ``UNSUPPORTED`` (a limitation of the library underneath, named). A config is
checked against the rules when it is made (:func:`check_combination`) and again once its degrees
are resolved for a world size (:func:`check_resolved`), so a refused combination fails by name
before anything changes. ``combinations()`` lists the matrix; the README's table is generated
from it (``python -m parallel.combinations``) and a test walks every built cell.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from collections.abc import Callable
from enum import Enum
from types import SimpleNamespace
from typing import Any

from parallel.config import (
    OperatorSplit,
    OptimizerLevel,
    ParallelConfig,
    Schedule,
    SearchMode,
    operator_split,
)


class Status(str, Enum):
    BUILT = "built"
    MEANINGLESS = "meaningless"
    UNSUPPORTED = "unsupported"


@dataclasses.dataclass(frozen=True)
class Feature:
    name: str
    what: str  # a short description for the table
    active: Callable[[ParallelConfig], bool]


def _data(c: ParallelConfig) -> bool:
    return operator_split(c) is OperatorSplit.REPLICAS or (c.data_degree or 1) > 1


def _split(split: OperatorSplit) -> Callable[[ParallelConfig], bool]:
    return lambda c: operator_split(c) is split


#: in the order of the README's table
FEATURES: tuple[Feature, ...] = (
    Feature("data", "data parallel (replicas average gradients)", _data),
    Feature("tensor", "semi-auto tensor parallel (DTensor strategies)",
            _split(OperatorSplit.STRATEGIES)),
    Feature("auto", "auto parallel (searched strategies)", _split(OperatorSplit.SEARCH)),
    Feature("hybrid", "hybrid parallel (the model's own collectives)",
            _split(OperatorSplit.MODEL)),
    Feature("pipeline", "pipeline stages", lambda c: c.pipeline_degree > 1),
    Feature("interleaved", "several stages per rank (interleaved_1f1b)",
            lambda c: c.pipeline_degree > 1 and c.schedule is Schedule.INTERLEAVED_1F1B),
    Feature("zero_bubble", "zero-bubble V schedule (zbv)",
            lambda c: c.pipeline_degree > 1 and c.schedule is Schedule.ZERO_BUBBLE_V),
    Feature("expert", "MoE expert parallel", lambda c: c.expert_degree > 1),
    Feature("context", "context parallel (the sequence split; ring or Ulysses attention)",
            lambda c: c.context_degree > 1),
    Feature("optimizer", "optimizer parallel (levels 1-3)", lambda c: c.enable_parallel_optimizer),
    Feature("param_dtype", "16-bit parameters under optimizer parallel",
            lambda c: c.param_dtype is not None),
    Feature("multi_copy", "multi-copy interleaving", lambda c: c.multi_copy > 1),
    Feature("per_rank_batch", "each data rank loads its own slice (full_batch=False)",
            lambda c: not c.full_batch),
    Feature("memory_limit", "auto search under max_device_memory",
            lambda c: c.max_device_memory is not None),
)
#: model-level features, known only at ``parallelize`` time (``set_device`` placement tags)
PLACEMENT = "placement"


@dataclasses.dataclass(frozen=True)
class Rule:
    features: frozenset[str]
    status: Status
    reason: str


def _rule(names: str, status: Status, reason: str) -> Rule:
    return Rule(frozenset(names.split()), status, reason)


M, U = Status.MEANINGLESS, Status.UNSUPPORTED

#: a config feature -> the optimizer-parallel feature it brings (``.optimizer_parallel.backends``)
_OPTIMIZER_FEATURE = {"tensor": "semi_auto", "auto": "semi_auto", "expert": "experts",
                      "pipeline": "pipeline", "param_dtype": "param_dtype"}


def _optimizer_rules() -> list[Rule]:
    """Optimizer parallel with two features no backend takes together (the backends'
    declarations, so the config refuses exactly what ``ShardedDataParallel`` would)."""
    from parallel.optimizer_parallel.backends import unbuilt

    rules = []
    for a, b in itertools.combinations(_OPTIMIZER_FEATURE, 2):
        why = unbuilt({_OPTIMIZER_FEATURE[a], _OPTIMIZER_FEATURE[b]})
        if why is not None:
            rules.append(_rule(f"optimizer {a} {b}", U, why))
    return rules
RULES: tuple[Rule, ...] = (
    _rule("interleaved zero_bubble", M, "one schedule at a time"),
    *(_rule(f"zero_bubble {mode}", U,
            "torch's zbv splits backward into input and weight passes, which torch.distributed."
            "pipelining cannot run through DTensor parameters; use 1f1b or interleaved_1f1b")
      for mode in ("tensor", "auto")),
    *(_rule(f"expert {mode} {other}", U, "not built yet: semi-auto (and auto) expert "
                                         "parallel runs without stages or copies")
      for mode in ("tensor", "auto") for other in ("pipeline", "multi_copy")),
    *(_rule(f"context {other}", U, "not built yet: context parallel runs with data "
                                   "parallel (context ranks average gradients as replicas)")
      for other in ("auto", "hybrid", "multi_copy")),
    # what no optimizer-parallel backend takes, as the backends declare it
    *_optimizer_rules(),
    # single features whose meaning needs another one
    _rule("param_dtype", M, "param_dtype is the parameters' dtype under optimizer parallel "
                            "(enable_parallel_optimizer=True)"),
    _rule("per_rank_batch", M, "full_batch=False is the dataset strategy of a split by "
                               "strategies (given or searched); without them each data rank "
                               "always feeds its own slice"),
    _rule("memory_limit", M, "max_device_memory bounds the plan of a search (search_mode "
                             "'dynamic_programming' or 'recursive_programming')"),
)
# rules that hold only when the features' pair appears *without* its enabling partner
_ENABLERS = {"param_dtype": ("optimizer",), "per_rank_batch": ("tensor", "auto"),
             "memory_limit": ("auto",)}


def active_features(config: ParallelConfig) -> list[str]:
    return [f.name for f in FEATURES if f.active(config)]


def _violations(active: set[str], maybe: frozenset[str] = frozenset()) -> list[Rule]:
    """The rules ``active`` breaks; a feature in ``maybe`` may still be switched on (by the
    model's ``parallel.shard`` tags, not yet seen), so it lifts the rules it enables."""
    found = []
    for rule in RULES:
        if not rule.features <= active:
            continue
        if len(rule.features) == 1:
            (name,) = rule.features
            if any(e in active or e in maybe for e in _ENABLERS.get(name, ())):
                continue
        found.append(rule)
    return found


def _raise(rules: list[Rule], active: list[str]) -> None:
    rule = rules[0]
    names = " × ".join(sorted(rule.features))
    raise ValueError(f"ParallelConfig: {names} is {rule.status.value}: {rule.reason} "
                     f"(this config switches on: {', '.join(active)})")


def check_combination(config: ParallelConfig) -> None:
    """ValueError naming the first refused combination of ``config``'s features."""
    active = active_features(config)
    # a config made before the model is seen may still meet parallel.shard tags
    maybe = frozenset({"tensor"}) if config.strategy_tags is None and \
        operator_split(config) in (OperatorSplit.REPLICAS, OperatorSplit.MODEL) else frozenset()
    rules = _violations(set(active), maybe)
    if rules:
        _raise(rules, active)
    if config.max_device_memory is not None and \
            config.search_mode is SearchMode.SHARDING_PROPAGATION:
        raise ValueError("ParallelConfig.max_device_memory bounds the plan of the searches "
                         "(search_mode 'dynamic_programming' or 'recursive_programming'), "
                         "not sharding_propagation's")
    if config.schedule is Schedule.ZERO_BUBBLE_V and config.virtual_stages != 2:
        raise ValueError(f"ParallelConfig.virtual_stages={config.virtual_stages}: the zbv "
                         f"schedule places exactly 2 stages per rank (a V)")
    if operator_split(config) is OperatorSplit.SEARCH and config.tensor_degree > 1 and \
            config.full_batch and not config.enable_parallel_optimizer and \
            config.expert_degree == 1:
        raise ValueError(f"ParallelConfig.tensor_degree={config.tensor_degree}: a search "
                         f"(search_mode={config.search_mode}) chooses how to split each "
                         f"operator over the stage's ranks; leave "
                         f"tensor_degree=1 (with enable_parallel_optimizer, full_batch=False or "
                         f"expert_degree > 1, tensor_degree bounds the ranks a parameter may be "
                         f"split over, the other data ranks holding replicas)")
    if config.offload_params:
        _check_offload_params(config, active)
    if config.context_degree > 1 and config.optimizer_weight_shard_size is not None:
        raise ValueError(f"ParallelConfig.context_degree={config.context_degree} with "
                         f"optimizer_weight_shard_size is not built yet: optimizer parallel "
                         f"shards over all the data × context ranks")
    if config.expert_degree > 1 and config.enable_parallel_optimizer and \
            config.optimizer_weight_shard_size is not None:
        raise ValueError(f"ParallelConfig.expert_degree={config.expert_degree} with "
                         f"optimizer_weight_shard_size is not built yet: optimizer parallel "
                         f"shards over all the data × expert ranks")


def _check_offload_params(config: ParallelConfig, active: list[str]) -> None:
    """``offload_params`` rests each rank's shards of the weights on its host: optimizer
    parallel level2/3, with what its backend takes (``.optimizer_parallel.backends``)."""
    if not config.enable_parallel_optimizer or config.optimizer_level is OptimizerLevel.LEVEL1:
        raise ValueError(f"ParallelConfig.offload_params=True rests each rank's shards of the "
                         f"weights on its host: it needs optimizer parallel level2 or level3 "
                         f"(enable_parallel_optimizer={config.enable_parallel_optimizer}, "
                         f"optimizer_level={config.optimizer_level}); whole weights are "
                         f"offloaded by hetero.offload.apply_offload")
    from parallel.optimizer_parallel.backends import unbuilt

    request = {"host_params", *(_OPTIMIZER_FEATURE[f] for f in active
                                if f in _OPTIMIZER_FEATURE)}
    why = unbuilt(request)
    if why is not None:
        raise ValueError(f"ParallelConfig.offload_params=True: {why}")


def check_resolved(config: ParallelConfig) -> None:
    """The checks that need the resolved ``data_degree`` (the rest ran when ``config`` was
    made: ``resolve`` makes it through ``dataclasses.replace``, which runs them again)."""
    if config.enable_parallel_optimizer:  # sharded over the replicas (data × expert × context)
        data, shard = config.batch_ranks, config.optimizer_weight_shard_size
        if config.replica_ranks == 1:
            raise ValueError("ParallelConfig.enable_parallel_optimizer=True shards over "
                             "data-parallel replicas, but data_degree=1: there is no replica to "
                             "share the optimizer with")
        if config.shards_operators and config.context_degree > 1 and \
                config.data_degree == 1:
            raise ValueError(f"ParallelConfig.enable_parallel_optimizer=True under strategies "
                             f"with context_degree={config.context_degree} shards over the "
                             f"strategies' data ranks (the context ranks hold the same shards "
                             f"and average their gradients), but data_degree=1; give "
                             f"data_degree >= 2 (a smaller tensor_degree) or drop "
                             f"enable_parallel_optimizer")
        if shard is not None and (shard > data or data % shard):
            raise ValueError(f"ParallelConfig.optimizer_weight_shard_size={shard} must divide "
                             f"the data_degree {data} (ranks sharing a shard; the groups "
                             f"replicate)")


def check_placement(config: ParallelConfig) -> None:
    """ValueError when ``set_device`` placement tags cannot run with ``config``'s features."""
    active = active_features(config)
    for name in active:
        status, reason = _PLACEMENT.get(name, (Status.BUILT, ""))
        if status is not Status.BUILT:
            raise ValueError(f"parallel.parallelize: hetero placement tags × {name} is "
                             f"{status.value}: {reason}")
    if "optimizer" in active:  # placed by whole modules, then sharded (the "placed" backend)
        from parallel.optimizer_parallel.backends import unbuilt

        for other, feature in _OPTIMIZER_FEATURE.items():
            why = unbuilt({"placed", feature}) if other in active else None
            if why is not None:
                raise ValueError(f"parallel.parallelize: hetero placement tags × optimizer × "
                                 f"{other} is unsupported: not built yet ({why}); drop the "
                                 f"tags or {other}")
    for mode in ("tensor", "auto"):
        if mode in active and "pipeline" in active:
            raise ValueError(f"parallel.parallelize: hetero placement tags × {mode} × pipeline "
                             f"is unsupported: not built yet (a stage would be graph-placed, "
                             f"then sharded); place a data-parallel pipeline, or shard without "
                             f"stages")


#: placement × one feature; semi-auto and auto place tagged modules themselves, by whole
#: modules, on the host twin of their mesh (``parallel.semi_auto.host``)
_PLACEMENT: dict[str, tuple[Status, str]] = {
    "context": (U, "not built yet: a placed model's captured graph holds the attention as "
                   "operators, which the context split's attention cannot replace"),
    "interleaved": (U, "a placed stage wraps its own forward, and interleaved schedules run "
                       "several stages per rank; use gpipe or 1f1b"),
    "zero_bubble": (U, "a placed stage wraps its own forward, and zbv runs two stages per "
                       "rank; use gpipe or 1f1b"),
}


#: feature -> (the fields that switch it on, fields it needs unless another feature sets them):
#: the smallest configs of the table's and the walking test's cells
WITNESSES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "data": ({"data_degree": 2}, {}),
    # each split's witness fixes the fields that choose it, so two splits conflict (meaningless)
    "tensor": ({"strategy_tags": True, "search_mode": None}, {"tensor_degree": 2}),
    "auto": ({"search_mode": SearchMode.SHARDING_PROPAGATION, "strategy_tags": False}, {}),
    "hybrid": ({"tensor_degree": 2, "strategy_tags": False, "search_mode": None}, {}),
    "pipeline": ({"pipeline_degree": 2}, {"micro_batches": 2}),
    "interleaved": ({"pipeline_degree": 2, "schedule": Schedule.INTERLEAVED_1F1B},
                    {"micro_batches": 4}),
    "zero_bubble": ({"pipeline_degree": 2, "schedule": Schedule.ZERO_BUBBLE_V},
                    {"micro_batches": 4}),
    "expert": ({"expert_degree": 2}, {}),
    "context": ({"context_degree": 2}, {}),
    "optimizer": ({"enable_parallel_optimizer": True}, {"data_degree": 2}),
    "multi_copy": ({"multi_copy": 2}, {}),
    "per_rank_batch": ({"full_batch": False}, {"strategy_tags": True, "data_degree": 2}),
}


def merged(*features: str) -> dict[str, Any] | None:
    """The witnesses of ``features`` in one set of fields; None when two of them set one field
    to different values (two operator splits, two schedules): meaningless together."""
    fields: dict[str, Any] = {}
    for name in features:
        for key, value in WITNESSES[name][0].items():
            if key in fields and fields[key] != value:
                return None
            fields[key] = value
    for name in features:
        for key, value in WITNESSES[name][1].items():
            fields.setdefault(key, value)
    return fields


def _status(features: tuple[str, ...]) -> tuple[Status, str]:
    names = [f for f in features if f != PLACEMENT]
    fields = merged(*names)
    if fields is None:
        return Status.MEANINGLESS, ("one operator split (or schedule) at a time: the "
                                    "strategies are given, searched or the model's own")
    defaults = {f.name: f.default for f in dataclasses.fields(ParallelConfig)
                if f.default is not dataclasses.MISSING}
    view = SimpleNamespace(**{**defaults, "stages": {}, "strategies": {}, **fields})
    active = active_features(view)  # type: ignore[arg-type]
    if PLACEMENT in features:
        for name in active:
            status, reason = _PLACEMENT.get(name, (Status.BUILT, ""))
            if status is not Status.BUILT:
                return status, reason
        return Status.BUILT, ""
    rules = _violations(set(active))
    return (rules[0].status, rules[0].reason) if rules else (Status.BUILT, "")


def combinations() -> dict[tuple[str, str], tuple[Status, str]]:
    """Every pair of features (placement tags included) -> (status, reason), as
    :func:`check_combination` decides it for the pair's witnesses."""
    names = [*WITNESSES, PLACEMENT]
    return {(a, b): _status((a, b)) for a, b in itertools.combinations(names, 2)}


_MARK = {Status.BUILT: "✓", Status.MEANINGLESS: "–", Status.UNSUPPORTED: "✗"}


def markdown_table() -> str:
    """The matrix as the README's Markdown table."""
    table = combinations()
    names = list(dict.fromkeys(n for pair in table for n in pair))
    lines = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for a in names:
        cells = []
        for b in names:
            status = (table.get((a, b)) or table.get((b, a)) or (None, ""))[0]
            cells.append(" " if status is None else _MARK[status])
        lines.append(f"| **{a}** | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("✓ built and tested equal to one process · – meaningless together · ✗ refused "
                 "(reason in `parallel.combinations()`)")
    whats = {f.name: f.what for f in FEATURES} | {PLACEMENT: "hetero.set_device placement tags"}
    lines.append("")
    lines.append(" · ".join(f"**{name}**: {whats[name]}" for name in names))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(markdown_table() + "\n")
