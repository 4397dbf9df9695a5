"""``trainer.keep_last=k``: keep only the k newest checkpoints of a run (rank 0 deletes).

Run after a checkpoint is complete (renamed into place by ``save_checkpoint``). The checkpoint
just written is always kept, whatever its step (a run resumed from an older checkpoint writes
steps below ones already there), and so are the k - 1 highest other steps; an unfinished
``step_N.tmp`` directory is never touched. ``k`` >= 1, so the only good checkpoint is never
deleted.

Only what this run wrote is ever deleted: a ``step_N`` whose manifest (``checksums.json``) names
this run directory. A symlink, a directory without the manifest (a user's folder, an older
version's checkpoint) and another run's checkpoint (two runs sharing ``trainer.checkpoint_dir``)
are left alone; :func:`foreign_checkpoints` lists them once at start-up so the run can say so
before any step is paid for.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from recipes.checkpoint import _STEP_DIR
from recipes.checkpoint_integrity import written_by

log = logging.getLogger(__name__)


def _step_dirs(root: str | os.PathLike) -> list[tuple[int, Path]]:
    return [(int(m.group(1)), p) for p in Path(root).glob("step_*")
            if (m := _STEP_DIR.match(p.name)) and (p.is_dir() or p.is_symlink())]


def _ours(path: Path, run: str) -> bool:
    return not path.is_symlink() and written_by(path) == run


def foreign_checkpoints(root: str | os.PathLike, run: str) -> list[Path]:
    """The ``step_N`` entries under ``root`` that ``keep_last`` will never delete for ``run``."""
    return sorted(p for _, p in _step_dirs(root) if not _ours(p, run))


def prune_checkpoints(root: str | os.PathLike, keep_last: int, current: Path, run: str
                      ) -> list[Path]:
    """Delete all but ``current`` and the ``keep_last - 1`` newest other complete checkpoints
    that ``run`` wrote under ``root``; return what was deleted."""
    if keep_last < 1:
        raise ValueError(f"trainer.keep_last={keep_last} must be >= 1 (null keeps every one)")
    current = Path(current).resolve()
    others = sorted(((step, p) for step, p in _step_dirs(root)
                     if _ours(p, run) and p.resolve() != current), reverse=True)
    doomed = [p for _, p in others[keep_last - 1:]]
    for path in doomed:
        shutil.rmtree(path)
    if doomed:
        log.info("trainer.keep_last=%d: removed %s", keep_last, ", ".join(p.name for p in doomed))
    return doomed
