"""A rank that dies at a chosen step: the fault the recovery tests inject (``trainer.kill_at``).

For tests only. ``trainer.kill_at=[RANK,STEP]`` makes rank RANK send itself ``SIGKILL`` as step
STEP begins: no exception, no clean-up, no flushed buffers — what a lost node or the kernel's
OOM killer does to a rank. It fires in the job's first attempt only (torchrun's
``TORCHELASTIC_RESTART_COUNT`` is 0, or unset without torchrun), so a job launched with
``torchrun --max-restarts 1 ... trainer.resume_from=auto`` restarts once, resumes from its last
checkpoint and runs on past STEP. ``trainer.kill_scope=node`` kills the rank's whole node instead:
its torchrun agent's process group (the agent and the node's workers), as a machine that goes
down; an elastic job (``--nnodes MIN:MAX``) then continues on the nodes left.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Sequence

log = logging.getLogger(__name__)
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"


def first_attempt() -> bool:
    """Whether this is the job's first attempt (not a restart by torchrun's agent)."""
    return os.environ.get(RESTART_ENV, "0") == "0"


def kill_if_chosen(kill_at: Sequence[int] | None, rank: int, step: int,
                   scope: str = "rank") -> None:
    """SIGKILL this process (``scope="node"``: its torchrun agent's process group first) when
    ``kill_at`` is ``[rank, step]`` and this is the first attempt (the module docstring)."""
    if kill_at is None or list(kill_at) != [rank, step] or not first_attempt():
        return
    log.warning("trainer.kill_at=[%d,%d]: rank %d kills %s (SIGKILL) as step %d begins",
                rank, step, rank, "its node" if scope == "node" else "itself", step)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    if scope == "node":
        os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def check_kill_at(kill_at: Sequence[int] | None, world: int) -> None:
    """ConfigError when ``kill_at`` names a rank the job's first attempt does not have (it
    would never fire, and the test relying on it would pass for the wrong reason)."""
    from recipes.fail_early import ConfigError

    if kill_at is not None and kill_at[0] >= world and first_attempt():  # a restarted job
        # may have lost the node the rank was on (elastic): the kill has happened by then
        raise ConfigError(f"trainer.kill_at=[{kill_at[0]},{kill_at[1]}] names rank {kill_at[0]}, "
                          f"and this job has {world} rank(s) (0..{world - 1})",
                          "name a rank of this job, or drop trainer.kill_at (it is for tests)")
