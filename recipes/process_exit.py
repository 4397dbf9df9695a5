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

Until the recipe's task starts, stderr is held (:class:`_StderrGate`): a command line Hydra
refuses (a typo in an override) is then one ``Config error:`` line on rank 0 instead of Hydra's
several lines on every rank (issue 38).
"""

from __future__ import annotations

import atexit
import io
import os
import sys
from collections.abc import Callable
from typing import NoReturn

_HYDRA_HINT = "Set the environment variable HYDRA_FULL_ERROR=1"


class _StderrGate(io.TextIOBase):
    """``sys.stderr`` while Hydra composes the config: held in a buffer until the recipe's task
    starts (:func:`open_stderr`), then passed through. Hydra reports a bad override (a typo) on
    every rank in several lines before any code of the recipe runs; held, it can be reported
    once, on one line (:func:`run_then_exit`). Anything else held is written out unchanged."""

    def __init__(self, stream: io.TextIOBase) -> None:
        super().__init__()
        self.stream, self.held, self.holding = stream, io.StringIO(), True

    def write(self, text: str) -> int:
        (self.held if self.holding else self.stream).write(text)
        return len(text)

    def flush(self) -> None:
        if not self.holding:
            self.stream.flush()

    def open(self) -> None:
        """Write out what was held and pass everything through from now on."""
        if self.holding:
            self.holding = False
            self.stream.write(self.held.getvalue())
            self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self.stream.encoding


def open_stderr() -> None:
    """The recipe's task has started (``recipes.base.run``): stderr passes through."""
    if isinstance(sys.stderr, _StderrGate):
        sys.stderr.open()


def run_then_exit(main: Callable[[], object]) -> NoReturn:
    """Run ``main`` (a ``@hydra.main`` entry point) and leave with its exit status, skipping the
    interpreter's teardown. An exception other than ``SystemExit`` propagates as usual (the
    interpreter prints it and exits with 1). A command line Hydra refuses before the task starts
    is one ``Config error:`` line on rank 0, and a quiet exit with the same code elsewhere."""
    gate = _StderrGate(sys.stderr)
    sys.stderr = gate
    try:
        main()
        status = 0
    except SystemExit as stop:
        status = _status(stop.code)
        held = gate.held.getvalue() if gate.holding else ""
        if status != 0 and _HYDRA_HINT in held:  # Hydra's own report of a refused override
            gate.held = io.StringIO()
            gate.open()  # the one line below goes straight out
            _report_once(held)
    finally:
        gate.open()
        sys.stderr = gate.stream
    atexit._run_exitfuncs()  # what Py_FinalizeEx would run first; no public spelling exists
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(status)


def _report_once(text: str) -> None:
    """Hydra's refusal, its message lines joined, as the one config-error line
    (``recipes.fail_early.report_config_error``: rank 0 says it, the others wait quietly)."""
    from recipes.fail_early import report_config_error

    lines = [line.strip() for line in text.splitlines()
             if line.strip() and not line[0].isspace() and not line.startswith(_HYDRA_HINT)]
    said = " ".join(line if line.endswith((".", ":")) else line + ";" for line in lines)
    report_config_error(said.rstrip(";"))


def _status(code: object) -> int:
    """``sys.exit``'s rule: None is 0, an int is itself, anything else is printed and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
