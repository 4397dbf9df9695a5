"""Pipeline parallel on ``torch.distributed.pipelining``.

    parallel.pipeline_stage(model.blocks[2], 1)        # tags (tags.py), or ParallelConfig.stages
    pipe = parallel.parallelize(model, ParallelConfig(pipeline_degree=2, micro_batches=4),
                                loss_fn=loss_fn)       # this rank's stages (build.py)
    loss = pipe.step(x, target=y)                      # one batch, all micro-batches (runtime.py)
    print(parallel.pipeline.explain_pipeline(pipe))             # the split (partition.py)

Units and the automatic, cost-balanced split live in partition.py, the dry run of each stage on
fake tensors in verify.py, the module-deletion split in carve.py, which stages a rank holds per
schedule in schedule.py, multi-copy inside stages in copies.py, the stage types that split backward
needs under optimizer parallel in sharded_stage.py and under parameter offload in
offloaded_stage.py.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from parallel.config import ParallelConfig
from parallel.pipeline.partition import StagePlan
from parallel.pipeline.runtime import Pipeline
from parallel.pipeline.tags import pipeline_stage


def __getattr__(name: str) -> Any:
    """``build_pipeline`` and ``make_plan`` from ``build.py``, imported when first asked for:
    it imports ``torch.distributed.pipelining`` (and with it ``torch._dynamo``, half a second),
    which a process that never builds a pipeline does without."""
    if name in ("build_pipeline", "make_plan"):
        from parallel.pipeline import build

        return getattr(build, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def explain_pipeline(model: nn.Module, config: ParallelConfig | None = None,
                     example_inputs: tuple | None = None) -> str:
    """The stage plan: for a ``Pipeline``, its own (and this rank's stages); for a model, the
    split ``config`` would make (with ``example_inputs`` the FLOPs are measured too)."""
    if isinstance(model, Pipeline):
        return (f"{model.plan.explain()}\n  schedule {model._parts.schedule_name}, "
                f"{model._parts.micro_batches} micro-batches; this rank runs stage(s) "
                f"{model.stage_indices}")
    if config is None:
        raise ValueError("explain_pipeline(model, config): give the ParallelConfig whose split "
                         "to explain (its pipeline degree, schedule and stages)")
    from parallel.pipeline.build import make_plan

    return make_plan(model, config, example_inputs).explain()


__all__ = ["Pipeline", "StagePlan", "build_pipeline", "explain_pipeline", "make_plan",
           "pipeline_stage"]
