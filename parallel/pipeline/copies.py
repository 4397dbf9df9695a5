"""Multi-copy inside pipeline stages (``ParallelConfig(pipeline_degree=P, multi_copy=C)``).

Each micro-batch a stage runs is split again into ``C`` copies, exactly as ``parallel.multi_copy``
splits a whole batch without pipeline: the stage's semi-auto redistributions (partial-sum
reductions, gathers) of copy ``i`` are in flight while copy ``i + 1`` computes the same
submodule, and MoE layers split their expert exchanges the same way. Pipeline micro-batches
already overlap one *stage's* point-to-point transfers with another's compute; the copies
overlap the collectives *inside* a stage, which micro-batches cannot (a stage's collectives run
between its own operators).

* a semi-auto stage is wrapped in :class:`parallel.multi_copy.MultiCopy` — every stage the rank
  holds, each carved from the rank's model and so sharing its semi-auto boundary (``root_io``);
  a stage semi-auto left whole (no strategy matches inside it) runs as one copy;
* MoE layers the rank holds take ``copies`` in place.

Data-parallel stages without MoE layers have nothing to overlap (their gradient reduction runs
once after the last micro-batch), so that combination is refused before the model changes.
"""

from __future__ import annotations

from torch import nn

from parallel.config import OperatorSplit, ParallelConfig
from parallel.multi_copy import MultiCopy, multi_copy
from parallel.nn.moe import MoE
from parallel.semi_auto.hooks import root_io
from parallel.semi_auto.shard import carries_strategies


def check_copies(model: nn.Module, config: ParallelConfig) -> None:
    """ValueError, before the split, when ``config.multi_copy`` copies would overlap nothing:
    no MoE layer, and no semi-auto strategy or ``parallel.shard`` tag."""
    if config.multi_copy == 1 or any(isinstance(m, MoE) for m in model.modules()):
        return
    if config.operator_split is OperatorSplit.STRATEGIES and (
            config.strategies or carries_strategies(model)):
        return
    raise ValueError(
        f"ParallelConfig.multi_copy={config.multi_copy} with pipeline_degree="
        f"{config.pipeline_degree}: copies overlap a stage's semi-auto redistributions or MoE "
        f"all-to-alls, and this model has neither (its operators split: "
        f"{config.operator_split.value}; a data-parallel stage reduces its gradients once per "
        f"step, after the last micro-batch); give strategies, or multi_copy=1")


def stage_copies(rank_model: nn.Module, stages: list[nn.Module], copies: int
                 ) -> list[nn.Module]:
    """The modules this rank's pipeline stages run, each micro-batch as ``copies`` copies (see
    the module docstring). ``rank_model``: the rank's part of the model, after the per-stage
    modes; ``stages``: its stage modules (``rank_model`` itself with one stage per rank)."""
    if copies == 1:
        return stages
    if any(isinstance(m, MoE) for m in rank_model.modules()):
        multi_copy(rank_model, copies)  # in place: every MoE layer the rank holds
        return stages
    io = root_io(rank_model)
    if io is None:  # semi-auto parallelized nothing inside these stages
        return stages
    return [MultiCopy(stage, copies, io=io) for stage in stages]
