"""``trainer.keep_last=k``: keep only the k newest checkpoints of a run (rank 0 deletes).

Run after a checkpoint is complete (renamed into place by ``save_checkpoint``). The checkpoint
just written is always kept, whatever its step (a run resumed from an older checkpoint writes
steps below ones already there), and so are the k - 1 highest other steps; an unfinished
``step_N.tmp`` directory is never touched. ``k`` >= 1, so the only good checkpoint is never
deleted.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from recipes.checkpoint import _STEP_DIR

log = logging.getLogger(__name__)


def prune_checkpoints(root: str | os.PathLike, keep_last: int, current: Path) -> list[Path]:
    """Delete all but ``current`` and the ``keep_last - 1`` newest other complete checkpoints
    under ``root``; return what was deleted."""
    if keep_last < 1:
        raise ValueError(f"trainer.keep_last={keep_last} must be >= 1 (null keeps every one)")
    current = Path(current).resolve()
    others = sorted(((int(m.group(1)), p) for p in Path(root).glob("step_*")
                     if (m := _STEP_DIR.match(p.name)) and p.is_dir()
                     and p.resolve() != current), reverse=True)
    doomed = [p for _, p in others[keep_last - 1:]]
    for path in doomed:
        shutil.rmtree(path)
    if doomed:
        log.info("trainer.keep_last=%d: removed %s", keep_last, ", ".join(p.name for p in doomed))
    return doomed
