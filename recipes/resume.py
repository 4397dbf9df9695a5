"""Which checkpoint a run resumes from (``trainer.resume_from``), the same rule for every recipe.

``null``: start fresh. ``latest``: the newest complete checkpoint under the run's checkpoint
directory, with a warning naming the settings when there is none (a launch without
``trainer.run_name`` gets a new run directory, so ``latest`` finds nothing there). ``auto``: the
same, starting fresh without a warning when there is none yet: the setting for a job that a
launcher restarts (``torchrun --max-restarts k``), whose first attempt finds nothing and whose
later attempts continue from the last checkpoint. Anything else is a checkpoint directory.

Rank 0 chooses and every rank takes its choice: ranks on several nodes may see a shared file
system at slightly different moments.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch.distributed as dist

from recipes.checkpoint import latest_checkpoint

log = logging.getLogger(__name__)


def resume_path(resume_from: str | None, ckpt_root: Path) -> Path | None:
    """The checkpoint ``trainer.resume_from`` names for a run whose checkpoints live in
    ``ckpt_root`` (None: start fresh)."""
    if resume_from is None:
        return None
    if resume_from not in ("latest", "auto"):
        return Path(resume_from)
    found = [latest_checkpoint(ckpt_root)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(found, src=0)
    if found[0] is None and resume_from == "latest":
        log.warning("trainer.resume_from=latest: no checkpoint in %s, starting fresh "
                    "(give trainer.run_name=NAME, or the same hydra.run.dir, at every "
                    "launch of a run you mean to resume)", ckpt_root)
    elif found[0] is None:
        log.info("trainer.resume_from=auto: no checkpoint in %s yet, starting fresh", ckpt_root)
    return found[0]


def check_fresh_start(resume_from: str | None, ckpt_root: Path) -> None:
    """Refuse a fresh start (``trainer.resume_from=null``) in a run directory that already holds
    checkpoints: the new run would overwrite the old one's ``metrics.jsonl`` and log while
    keeping its checkpoints, and a later ``resume_from=latest`` would mix the two runs."""
    if resume_from is not None:
        return
    found = latest_checkpoint(ckpt_root)
    if found is not None:
        raise ValueError(
            f"{ckpt_root} already holds checkpoints of an earlier run (newest: {found.name}); "
            f"a fresh start there would overwrite that run's metrics and a later "
            f"trainer.resume_from=latest would mix the two: resume it with "
            f"trainer.resume_from=latest, give another trainer.run_name, or remove "
            f"{ckpt_root.parent}")
