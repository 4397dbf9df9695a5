"""``trainer.profile_steps=[a,b]``: a torch profiler trace of training steps a..b, rank 0 only.

The trace is Chrome's JSON trace format (open it in ``chrome://tracing`` or Perfetto), written to
``RUN_DIR/profile_steps_A-B_rank0.json`` when step b ends (or when the run stops inside the
window). Activities are whatever ``torch.profiler.supported_activities()`` says this build can
record (the host always, the accelerator's kernels where there is one), so no device is named
here. Each step is one ``record_function`` range named ``step N``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def check_profile_steps(steps: Sequence[int] | None, max_steps: int) -> list[str]:
    """What is wrong with ``trainer.profile_steps`` (nothing when null)."""
    if steps is None:
        return []
    steps = list(steps)
    if len(steps) != 2 or not all(isinstance(s, int) for s in steps):
        return [f"trainer.profile_steps={steps} must be two steps [first, last]"]
    first, last = steps
    if not 1 <= first <= last <= max_steps:
        return [f"trainer.profile_steps={steps} must satisfy 1 <= first <= last <= "
                f"trainer.max_steps={max_steps}"]
    return []


class StepProfiler:
    """Starts ``torch.profiler`` when step ``first`` begins and saves the trace after ``last``."""

    def __init__(self, steps: Sequence[int] | None, run_dir: str | os.PathLike,
                 enabled: bool) -> None:
        self.window = tuple(steps) if steps is not None and enabled else None
        self.run_dir = Path(run_dir)
        self._prof: torch.profiler.profile | None = None
        self._range: torch.profiler.record_function | None = None
        self.trace: Path | None = None

    def begin(self, step: int) -> None:
        """Before step ``step`` runs."""
        if self.window is None:
            return
        if step == self.window[0] or (self._prof is None and self.window[0] < step
                                      <= self.window[1]):  # a resumed run starts inside
            self._prof = torch.profiler.profile(
                activities=sorted(torch.profiler.supported_activities(), key=str),
                record_shapes=True, with_stack=False)
            self._prof.__enter__()
            self._first = step
        if self._prof is not None:
            self._last_begun = step
            self._range = torch.profiler.record_function(f"step {step}")
            self._range.__enter__()

    def end(self, step: int) -> None:
        """After step ``step`` ran (its metrics logged)."""
        if self._prof is None:
            return
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if step >= self.window[1]:
            self._save(step)

    def _save(self, last: int) -> None:
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.trace = self.run_dir / f"profile_steps_{self._first}-{last}_rank0.json"
        prof.export_chrome_trace(str(self.trace))
        log.info("profiler trace of steps %d..%d: %s", self._first, last, self.trace)

    def close(self) -> None:
        """Save what was recorded when the run stops inside the window."""
        if self._prof is not None:
            if self._range is not None:
                self._range.__exit__(None, None, None)
                self._range = None
            self._save(self._last_begun)
