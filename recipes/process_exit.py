"""A recipe process's exit: its exit handlers run and its streams are flushed, then ``os._exit``;
the interpreter's own teardown (``Py_FinalizeEx``) is skipped.

Why (issue 44): a gloo process group that is still referenced when the interpreter finalizes
keeps its worker threads running. When one of them drops the last reference to a finished
collective's tensors it needs the GIL, and a finalizing Python ends such a thread with
``pthread_exit`` inside a ``noexcept`` destructor (``ProcessGroupGloo::AsyncWork``): the process
aborts with "terminate called without an active exception" after training succeeded, and
torchrun reports the job failed. Core dumps of 3 such aborts in 81 runs under load showed exactly
that stack. ``parallel.destroy`` frees the groups it can reach, but a DTensor or hook the program
(or torch) still holds keeps one alive, and torch has no call that joins a gloo group's threads.
A recipe has nothing left for the teardown to do once its ``cleanup`` and the exit handlers
(``atexit``: logging, loggers' flushes) have run, so it leaves without it, as a C program would.
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Callable
from typing import NoReturn


def run_then_exit(main: Callable[[], object]) -> NoReturn:
    """Run ``main`` (a ``@hydra.main`` entry point) and leave with its exit status, skipping the
    interpreter's teardown. An exception other than ``SystemExit`` propagates as usual (the
    interpreter prints it and exits with 1)."""
    try:
        main()
        status = 0
    except SystemExit as stop:
        status = _status(stop.code)
    atexit._run_exitfuncs()  # what Py_FinalizeEx would run first; no public spelling exists
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(status)


def _status(code: object) -> int:
    """``sys.exit``'s rule: None is 0, an int is itself, anything else is printed and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
