"""Start-up checks of the run settings that relate several config groups (loggers, precision,
compile, profiler), run by :func:`recipes.base.run` after the schema checks and before any
process group, data or model exists: each refusal names the setting, the rule and the fix."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from recipes.compiling import check_compile
from recipes.loggers import check_loggers
from recipes.precision import check_precision
from recipes.profiling import check_profile_steps
from recipes.schedules import check_schedule


def check_run_settings(cfg: DictConfig) -> None:
    """Raise (ValueError, or ModuleNotFoundError for a logger's missing package) on the first
    kind of problem found, naming every problem of that kind."""
    check_loggers(OmegaConf.to_container(cfg.get("logger", ["jsonl"])))
    if "offload" in cfg:  # first: the checks below read the names it keeps in step
        from recipes.offload import resolve_offload

        resolve_offload(cfg)
    t = cfg.trainer
    steps = t.get("profile_steps")
    problems = check_profile_steps(None if steps is None else OmegaConf.to_container(steps),
                                   t.max_steps)
    problems += check_precision(cfg) + check_compile(cfg)
    o = cfg.get("optim")
    if o is not None and "warmup_steps" in o:  # a WSD that cannot fit is refused here
        check_schedule(o.get("schedule", "cosine"), o.warmup_steps,
                       o.get("total_steps") or t.max_steps, o.get("decay_fraction", 0.2))
    if problems:
        raise ValueError("; ".join(problems))
