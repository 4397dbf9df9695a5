"""Run pytest with every process on the quarantine allocator (``.ci/quarantine.c``; issue 44).

Each freed block is filled with a pattern and held back, and checked when it leaves: a write
after free, a write past a block's end or a second free is reported with the stack that freed
the block. Unlike valgrind (``make memcheck``) it runs at native speed with the threads as they
are, so a race between gloo's threads and the main thread is caught where it writes. The test
process, the pooled and fresh gloo ranks and the recipe launches all load it (``LD_PRELOAD``);
their reports go to one log, which pytest's capture of stderr cannot hide.

    python .ci/quarantine.py                                 # the pipeline x expert tests
    python .ci/quarantine.py tests -x                        # the whole suite (about 2x slower)
    QUARANTINE_MB=64 python .ci/quarantine.py tests/test_expert_combinations.py

Fails when pytest fails or when the log holds any report.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = Path(__file__).with_suffix(".c")
DEFAULT_TESTS = ["tests/test_expert_combinations.py", "tests/test_heap_checks.py"]
REPORT = re.compile(r"^\[quarantine pid (\d+)\] (write after free|write past the end|free of a "
                    r"block already freed|signal \d+)", re.M)


def build(out_dir: Path) -> Path:
    """Compile the library into ``out_dir``; raises naming the missing compiler."""
    compiler = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("quarantine: no C compiler (gcc or $CC) to build .ci/quarantine.c")
    library = out_dir / "quarantine.so"
    subprocess.run([compiler, "-O2", "-Wall", "-shared", "-fPIC", "-o", str(library),
                    str(SOURCE), "-lpthread"], check=True)
    return library


def reports(log: str) -> list[str]:
    """The reports of a quarantine log, each its first line and what follows up to the next."""
    starts = [m.start() for m in REPORT.finditer(log)] + [len(log)]
    return [log[a:b].strip() for a, b in zip(starts, starts[1:], strict=False)]


def environment(library: Path, log: Path) -> dict[str, str]:
    """The environment that puts a process and its children on the library."""
    env = {**os.environ, "LD_PRELOAD": str(library), "QUARANTINE_LOG": str(log)}
    # import compiled modules instead of compiling each in every rank (faster under the checks)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="quarantine-") as tmp:
        library, log = build(Path(tmp)), Path(tmp) / "reports.log"
        code = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                               *(argv or DEFAULT_TESTS)],
                              cwd=ROOT, env=environment(library, log)).returncode
        found = reports(log.read_text(errors="replace")) if log.exists() else []
    for report in found[:10]:
        print(report, "\n", file=sys.stderr)
    print(f"quarantine: pytest exit code {code}; {len(found)} reports of heap misuse")
    return 1 if found or code else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
