"""Which checkpoint a run resumes from (``trainer.resume_from``), the same rule for every recipe.

``null``: start fresh. ``latest``: the newest complete checkpoint under the run's checkpoint
directory, with a warning naming the settings when there is none (a launch without
``trainer.run_name`` gets a new run directory, so ``latest`` finds nothing there). Anything else
is a checkpoint directory.
"""

from __future__ import annotations

import logging
from pathlib import Path

from recipes.checkpoint import latest_checkpoint

log = logging.getLogger(__name__)


def resume_path(resume_from: str | None, ckpt_root: Path) -> Path | None:
    """The checkpoint ``trainer.resume_from`` names for a run whose checkpoints live in
    ``ckpt_root`` (None: start fresh)."""
    if resume_from is None:
        return None
    if resume_from == "latest":
        found = latest_checkpoint(ckpt_root)
        if found is None:
            log.warning("trainer.resume_from=latest: no checkpoint in %s, starting fresh "
                        "(give trainer.run_name=NAME, or the same hydra.run.dir, at every "
                        "launch of a run you mean to resume)", ckpt_root)
        return found
    return Path(resume_from)


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
