"""A quiet rank's start under torchrun: stopped before its config check, it leaves with the
config error's exit code rather than being reported as killed.

torchrun stops every worker as soon as one exits. When a config error ends rank 0, which reports
it (``recipes/fail_early.py``), a rank still importing torch on a loaded machine has not reached
its own check, where it would wait for that stop and leave with :data:`EXIT_CODE`: it died of
the SIGTERM (exit -15, a rank "killed" in torchrun's summary). So each recipe calls
:func:`hold_stop` on its first lines, before its heavy imports (this module imports nothing
else), and :func:`release_stop` once every check has passed: a stop during training is a stop.
"""

from __future__ import annotations

import os
import signal
from typing import Any

#: the exit code of a config error (Hydra's for an error in the task function)
EXIT_CODE = 1
_before: list[Any] = []


def hold_stop() -> None:
    """On a rank other than 0 of a torchrun job: SIGTERM exits with :data:`EXIT_CODE`."""
    if os.environ.get("RANK", "0") != "0" and not _before:
        _before.append(signal.signal(signal.SIGTERM, lambda *_: os._exit(EXIT_CODE)))


def release_stop() -> None:
    """SIGTERM as it was before :func:`hold_stop`."""
    if _before:
        signal.signal(signal.SIGTERM, _before.pop())
