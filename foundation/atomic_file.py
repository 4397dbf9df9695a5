"""``write_text_atomic``: a text file replaced whole, never seen half-written.

Why: ranks that save the same plan or profile to one path (every rank of a job runs the same
script) would otherwise truncate the file under a rank reading it, which then reads an empty or
partial YAML. Each writer writes its own temporary file beside the target and renames it over the
target (``os.replace`` is atomic on one file system), so a reader sees one whole version.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file in its directory; returns the
    path.
    The temporary file is removed if the write fails."""
    path = Path(path)
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
