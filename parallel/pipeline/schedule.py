"""The schedules: which stages a rank holds and torch's schedule class that runs them.

``gpipe`` / ``1f1b``: one stage per rank. ``interleaved_1f1b``: ``virtual_stages`` per rank,
looped (rank r holds r, r + P, ...). ``zbv``: two per rank in a V (rank r holds r and 2P - 1 - r),
so the first and last stage share rank 0. Micro-batch rules are checked here, before anything
runs, with the schedule and the rule named (torch checks some of them only at the first step).
"""

from __future__ import annotations

import warnings

from parallel.config import Schedule

SINGLE = tuple(s for s in Schedule if s.stages_per_rank_fixed)


def schedule_class(schedule: str) -> type:
    """torch's class that runs ``schedule``. Imported here, when a pipeline is built:
    ``torch.distributed.pipelining`` imports ``torch._dynamo``, half a second of every process
    that imports ``parallel`` and never pipelines."""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleZBVZeroBubble,
    )

    return {Schedule.GPIPE: ScheduleGPipe, Schedule.ONE_F_ONE_B: Schedule1F1B,
            Schedule.INTERLEAVED_1F1B: ScheduleInterleaved1F1B,
            Schedule.ZERO_BUBBLE_V: ScheduleZBVZeroBubble}[Schedule(schedule)]


def __getattr__(name: str) -> object:
    """``SCHEDULE_CLASSES``, the previous release's table (DeprecationWarning): it imported
    torch's pipelining with this module."""
    if name == "SCHEDULE_CLASSES":
        warnings.warn("parallel.pipeline.schedule.SCHEDULE_CLASSES is deprecated, use "
                      "schedule_class(schedule)", DeprecationWarning, stacklevel=2)
        return {s: schedule_class(s) for s in Schedule}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def num_stages(schedule: str, ranks: int, virtual_stages: int) -> int:
    """Stages in the whole pipeline for ``ranks`` pipeline ranks."""
    return ranks if schedule in SINGLE else ranks * (2 if schedule == "zbv" else virtual_stages)


def rank_stages(schedule: str, rank: int, ranks: int, virtual_stages: int) -> list[int]:
    """The stage indices pipeline rank ``rank`` holds, in schedule order."""
    if schedule in SINGLE:
        return [rank]
    if schedule == "zbv":
        return [rank, 2 * ranks - 1 - rank]
    return [rank + k * ranks for k in range(virtual_stages)]


def stage_rank(schedule: str, stage: int, ranks: int, virtual_stages: int) -> int:
    """The pipeline rank holding ``stage``."""
    for rank in range(ranks):
        if stage in rank_stages(schedule, rank, ranks, virtual_stages):
            return rank
    raise ValueError(f"stage {stage} is outside the pipeline")


def check_micro_batches(schedule: str, micro_batches: int, ranks: int, stages: int) -> None:
    """ValueError naming the schedule's rule when ``micro_batches`` cannot feed it."""
    if schedule == "1f1b" and micro_batches < stages:
        raise ValueError(f"schedule '1f1b' needs at least as many micro-batches as stages: "
                         f"micro_batches={micro_batches} < {stages} stages")
    if schedule in ("interleaved_1f1b", "zbv") and micro_batches % ranks:
        raise ValueError(f"schedule {Schedule(schedule).value!r} runs micro-batches in rounds "
                         f"of the {ranks} "
                         f"pipeline ranks: micro_batches={micro_batches} is not a multiple of "
                         f"{ranks}")


def check_batch(batch: int, micro_batches: int) -> None:
    if batch % micro_batches:
        raise ValueError(f"pipeline: a batch of {batch} samples does not divide into "
                         f"micro_batches={micro_batches} equal micro-batches")
