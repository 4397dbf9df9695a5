"""Every Python block of the README and of ``docs/`` runs as written.

A block is a fenced code block whose info string starts with ``python``. It runs
as a script's ``__main__`` in an empty directory, the way a newcomer would paste it into a file:

* ```` ```python ```` runs as ``python snippet.py`` would;
* ```` ```python ranks=N ```` runs on N gloo ranks with torchrun's environment, as
  ``torchrun --nproc-per-node N`` runs it (the block says so in its first comment line, so a
  reader knows how to launch it): the ranks are the session's pooled ones (``rank_pool.py``: a
  fresh process group, environment and seed per task), where the block runs as ``__main__`` in
  its own directory, without the repository on its path (a plain block: on one such rank,
  without torchrun's variables); ``ranks=2,1`` runs it on 2 ranks
  and again as one plain process (``1``: ``python snippet.py``), for a block the text says works
  both ways;
* ```` ```python no-run ```` is shown, not run (a fragment of a larger program; use sparingly).

So a snippet that drifts from the code fails here, not in a user's terminal.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from distributed import run_ranks

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```python([^\n]*)\n(.*?)^```\s*$", re.M | re.S)
_RANKS = re.compile(r"\branks=(\d+(?:,\d+)*)\b")


def _blocks() -> list:
    found = []
    for path in DOCUMENTS:
        text = path.read_text()
        for match in _BLOCK.finditer(text):
            info, code = match.group(1), match.group(2)
            if "no-run" in info:
                continue
            line = text.count("\n", 0, match.start()) + 1
            ranks = _RANKS.search(info)
            name = f"{path.relative_to(ROOT)}:{line}"
            counts = [int(n) for n in ranks.group(1).split(",")] if ranks else [0]
            found += [pytest.param(code, 0 if n == 1 else n,
                                   id=name if len(counts) == 1 else f"{name}:ranks={n}")
                      for n in counts]
    return found


def test_the_documents_have_runnable_blocks():
    """Guards the extraction itself: a renamed fence would silently test nothing."""
    assert len(_blocks()) >= 10


def _block_on_rank(rank: int, world: int, script: str, plain: bool) -> None:
    """One rank of a block: run as ``__main__`` from its directory, the repository's own
    directories off ``sys.path`` while it runs (a user's script sees the installed packages).
    ``plain``: as ``python snippet.py``, without torchrun's variables."""
    import runpy

    if plain:
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                     "MASTER_PORT"):
            os.environ.pop(name, None)
    ours = {str(ROOT), str(ROOT / "tests")}
    path = list(sys.path)
    os.chdir(Path(script).parent)
    sys.path[:] = [Path(script).parent.as_posix(), *(p for p in path if p not in ours)]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.path[:] = path
        os.chdir(ROOT)


@pytest.mark.slow
@pytest.mark.parametrize(("code", "ranks"), _blocks())
def test_the_block_runs_as_written(code: str, ranks: int, tmp_path: Path):
    script = tmp_path / "snippet.py"
    script.write_text(code)
    run_ranks(_block_on_rank, ranks or 1, str(script), ranks == 0, timeout=240)
