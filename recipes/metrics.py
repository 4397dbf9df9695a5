"""Per-step metrics as JSON lines (``metrics.jsonl`` in the run directory), written by rank 0.

One object per line, flushed as it is written, so a crashed or running job can be inspected with
``tail``/``jq``. When a run resumes into the same directory, lines past the resumed step (steps
that were trained but never checkpointed) are dropped first, so each step appears once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from foundation.atomic_file import write_text_atomic


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of a metrics file, in order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class MetricsLogger:
    """Appends one JSON object per ``log`` call; a no-op unless ``enabled`` (rank 0)."""

    def __init__(self, path: str | os.PathLike, enabled: bool, resume_step: int = 0) -> None:
        self.path = Path(path)
        self._file = None
        if not enabled:
            return
        if self.path.exists():
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self._file = open(self.path, "a", encoding="utf-8")

    def log(self, **record: Any) -> None:
        """Write ``record`` (floats keep full precision: json writes their repr)."""
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
