"""Every Python block of the README and of ``docs/`` runs as written.

A block is a fenced code block whose info string starts with ``python``. It runs in a fresh
interpreter in an empty directory, the way a newcomer would paste it into a file:

* ```` ```python ```` runs with ``python snippet.py``;
* ```` ```python ranks=N ```` runs under ``torchrun --nproc-per-node N`` on gloo (the block says so
  in its first comment line, so a reader knows how to launch it); ``ranks=2,1`` runs it on 2 ranks
  and again as one plain process (``1``: ``python snippet.py``), for a block the text says works
  both ways;
* ```` ```python no-run ```` is shown, not run (a fragment of a larger program; use sparingly).

So a snippet that drifts from the code fails here, not in a user's terminal.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.slow
@pytest.mark.parametrize(("code", "ranks"), _blocks())
def test_the_block_runs_as_written(code: str, ranks: int, tmp_path: Path):
    script = tmp_path / "snippet.py"
    script.write_text(code)
    if ranks:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(ranks), str(script)]
    else:
        command = [sys.executable, str(script)]
    # the installed packages only, as a user has them: a block importing the repo's `recipes`
    # (not installed) or `tests` fails here as it would for them
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, f"the block failed:\n{code}\n--- output ---\n" + (
        done.stdout + done.stderr)[-4000:]
