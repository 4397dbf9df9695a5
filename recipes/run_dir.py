"""One run directory for all ranks of a torchrun job.

Hydra resolves ``hydra.run.dir`` in every rank separately and before the process group exists, so
``${now:...}`` can land two ranks in two directories when their clocks straddle a second. The
resolvers here make the directory a deterministic function of the launch:

* ``hp.launch_time:FMT`` formats the start time of the torchrun agent (the parent process every
  rank shares) under torchrun, and the current time (cached, so stable within a process) otherwise;
* ``hp.run_dir:NAME[,RECIPE]`` is ``outputs/[RECIPE/]runs/NAME`` for a named run (stable across
  launches), else the launch-time directory above;
* ``hp.rank_zero_only:VALUE`` is VALUE on rank 0 and null elsewhere (``hydra.output_subdir``), so
  only rank 0 writes ``.hydra/``;
* ``hp.rank_log_name:NAME`` is ``NAME.log`` on rank 0 and ``NAME_rank<r>.log`` elsewhere.

:func:`agree_on_run_dir` then checks, once the process group is up, that every rank really did
land in rank 0's directory and adopts rank 0's if not (e.g. agents on different hosts).
"""

from __future__ import annotations

import logging
import os
import time
from datetime import datetime
from functools import lru_cache
from typing import Any

import torch.distributed as dist
from omegaconf import OmegaConf

from parallel.comm import launched_by_torchrun
from recipes.help_text import config_groups

log = logging.getLogger(__name__)


def env_rank() -> int:
    """The global rank torchrun gave this process (0 when not launched by torchrun)."""
    return int(os.environ.get("RANK", "0"))


@lru_cache(maxsize=1)
def launch_timestamp() -> float:
    """Seconds since the epoch at which this job was launched, identical on all local ranks.

    Cached, so the date and time parts of one run dir come from the same instant. Under torchrun
    the parent process is the agent every local rank shares."""
    if launched_by_torchrun():
        import psutil  # here: its import reads /proc (0.1 s of every process's start)

        return psutil.Process(os.getppid()).create_time()
    return time.time()


def _launch_time(fmt: str) -> str:
    return datetime.fromtimestamp(launch_timestamp()).strftime(fmt)


def _run_dir(name: str | None, recipe: str = "") -> str:
    """``outputs/[RECIPE/]runs/NAME`` for ``trainer.run_name=NAME`` — the same directory at every
    launch, so ``trainer.resume_from=latest`` finds the previous launch's checkpoints — else a
    directory named after the launch time (``recipe``: a sub-directory per recipe)."""
    base = f"outputs/{recipe}" if recipe else "outputs"
    if name is None:
        return f"{base}/{_launch_time('%Y-%m-%d')}/{_launch_time('%H-%M-%S')}"
    if not name or "/" in name or name in (".", ".."):
        # Hydra resolves this before the task runs: reported here, once, or it would end a
        # 100-line traceback of Hydra's and OmegaConf's frames on every rank
        from recipes.fail_early import config_errors_once

        with config_errors_once():
            raise ValueError(f"trainer.run_name={name!r} must be a non-empty name without '/' "
                             f"(it names a directory under {base}/runs/)")
    return f"{base}/runs/{name}"


def _rank_zero_only(value: Any) -> Any:
    return value if env_rank() == 0 else None


def _rank_log_name(job_name: str) -> str:
    rank = env_rank()
    return f"{job_name}.log" if rank == 0 else f"{job_name}_rank{rank}.log"


def register_resolvers() -> None:
    """Register the ``hp.*`` resolvers; must run before ``@hydra.main`` composes the config."""
    for name, fn in (
        ("hp.launch_time", _launch_time),
        ("hp.run_dir", _run_dir),
        ("hp.rank_zero_only", _rank_zero_only),
        ("hp.rank_log_name", _rank_log_name),
        ("hp.config_groups", config_groups),  # --help's groups, schemas left out
    ):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn, use_cache=True)


def agree_on_run_dir(run_dir: str) -> str:
    """Return rank 0's run directory on every rank (call after the process group is up)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return run_dir
    shared = [os.path.abspath(run_dir)]
    dist.broadcast_object_list(shared, src=0)
    if shared[0] != os.path.abspath(run_dir):
        log.warning("rank %d run dir %s differs from rank 0's; using %s",
                    dist.get_rank(), run_dir, shared[0])
        os.makedirs(shared[0], exist_ok=True)
    return shared[0]
