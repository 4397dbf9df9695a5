"""``parallel.pipeline_stage(module, k)``: say which pipeline stage runs a module.

The reference tags cells (``cell.pipeline_stage = k``); here the tag is an attribute on the
module, read when the model is split, and the reference's own spelling works too
(``module.pipeline_stage = 1``). ``ParallelConfig.stages`` (module path -> stage) adds tags from a
config or recipe file without touching the model.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

_ATTR = "_hp_pipeline_stage"


def pipeline_stage(module: nn.Module, stage: int) -> nn.Module:
    """Run ``module`` (a layer, or a container of layers) in pipeline stage ``stage`` (0-based).
    Returns ``module``."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"pipeline_stage tags an nn.Module, got {type(module).__name__}")
    if not isinstance(stage, int) or isinstance(stage, bool) or stage < 0:
        raise ValueError(f"pipeline_stage: stage must be an int >= 0, got {stage!r}")
    object.__setattr__(module, _ATTR, stage)
    return module


def stage_tags(model: nn.Module, extra: Mapping[str, int] | None = None) -> dict[str, int]:
    """Module path -> stage from the tags on ``model``'s modules and ``extra`` (config paths);
    a path tagged both ways must agree."""
    tags = {}
    for path, m in model.named_modules():
        stage = getattr(m, _ATTR, m.__dict__.get("pipeline_stage"))  # ours, or MindSpore's
        if stage is not None:
            if not isinstance(stage, int) or isinstance(stage, bool) or stage < 0:
                raise ValueError(f"pipeline stages: {path or type(model).__name__}.pipeline_stage"
                                 f" must be an int >= 0, got {stage!r}")
            tags[path] = stage
    modules = dict(model.named_modules())
    for path, stage in (extra or {}).items():
        if path not in modules:
            raise ValueError(f"pipeline stages: {path!r} is not a module of "
                             f"{type(model).__name__}")
        if tags.get(path, stage) != stage:
            raise ValueError(f"pipeline stages: {path!r} is tagged stage {tags[path]} and the "
                             f"config says stage {stage}; give it one")
        tags[path] = stage
    return tags
