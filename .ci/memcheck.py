"""One rank of the pipeline × expert cases under valgrind's memcheck, the others native (issue 44).

A full suite once saw a rank of ``tests/test_expert_combinations.py`` abort with ``malloc():
unaligned tcache chunk detected``: something wrote into freed heap memory. glibc's own checks
(``tests/test_heap_checks.py``) only notice a write that lands on the allocator's bookkeeping;
memcheck sees every load and store of the process, torch's and gloo's native code included, so
a use after free, a double free or a write past a buffer is reported where it happens, with the
stacks of the access, of the ``free`` and of the allocation. Threads run one at a time under
valgrind, so a race may hide: this complements, and does not replace, the repeated runs.

    python .ci/memcheck.py --rank 0          # about 8 minutes on 2 cores; make memcheck
    python .ci/memcheck.py --rank 3 --cases 0,1

The rank's log is kept (``--log``); the summary counts its errors by kind. Heap misuse (invalid
reads and writes, frees of what was not allocated or already freed) fails the run. Reads of
uninitialised values are counted but pass: torch and CPython report hundreds from padding and
stack temporaries (``std::optional``, a ``PyLong``'s digits) that never reach a result.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORLD = 4
MISUSE = re.compile(r"Invalid (read|write|free)|Mismatched free|free'd|"
                    r"Source and destination overlap|Argument .* of function .* has a fishy")
UNINITIALISED = re.compile(r"^(Conditional jump or move depends on uninitialised|"
                           r"Use of uninitialised value|Syscall param .* uninitialised)")
# glibc's dynamic loader reads past the end of rpath strings with word-sized compares while it
# loads torch's libraries: a known false positive of memcheck, not this process's heap
LOADER = re.compile(r"\((dl-[a-z-]+\.c|strcmp-sse2\.S|rtld\.c):")


def error_blocks(log: str) -> list[list[str]]:
    """The error reports of a memcheck log: each its lines without the ``==pid==`` prefix."""
    blocks: list[list[str]] = [[]]
    for line in log.splitlines():
        text = re.sub(r"^==\d+== ?", "", line)
        if not text.strip():
            blocks.append([])
        else:
            blocks[-1].append(text)
    return [b for b in blocks if b and (MISUSE.search(b[0]) or UNINITIALISED.search(b[0]))]


def heap_misuse(log: str) -> list[list[str]]:
    """The reports of ``log`` that are heap misuse, the dynamic loader's left out."""
    return [block for block in error_blocks(log) if MISUSE.search(block[0])
            and not all(LOADER.search(frame) for frame in block[1:4])]


def summary(log: str) -> dict[str, int]:
    """How many reports of each kind ``log`` holds (the first line of each, addresses cut)."""
    counts: dict[str, int] = {}
    for block in error_blocks(log):
        kind = re.sub(r"0x[0-9A-Fa-f]+|\d+", "N", block[0])
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def _worker() -> None:
    """A rank: the chosen pipeline × expert cases of the suite, once, printing their losses."""
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
    import torch

    import parallel
    from test_expert_combinations import CASES
    from test_heap_checks import PIPELINE_CASES

    torch.set_num_threads(1)
    names = [PIPELINE_CASES[int(i)] for i in os.environ["MEMCHECK_CASES"].split(",")]
    parallel.init()
    for name in names:
        start = time.perf_counter()
        losses = CASES[name][0](CASES[name][1])[0]
        print(f"rank {os.environ['RANK']} {name}: {losses} ({time.perf_counter() - start:.1f} s)",
              flush=True)
    parallel.destroy()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=0, help="the rank run under memcheck (0-3)")
    parser.add_argument("--cases", default="0,1,2,3",
                        help="which pipeline cases of test_expert_combinations.py (0-3)")
    parser.add_argument("--log", type=Path, default=Path("memcheck"), help="folder for the logs")
    args = parser.parse_args()
    if not 0 <= args.rank < WORLD:
        parser.error(f"--rank must be one of 0..{WORLD - 1}, got {args.rank}")
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        print("memcheck: valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
    from distributed import free_port, rank_env

    args.log.mkdir(parents=True, exist_ok=True)
    port, procs = free_port(), []
    # the interpreter itself: under pyenv ``python`` is a shell script valgrind would check
    python = os.path.realpath(sys.executable)
    for rank in range(WORLD):
        env = {**os.environ, **rank_env(rank, WORLD, port), "MEMCHECK_CASES": args.cases,
               "HETERO_PARALLEL_TIMEOUT_S": "3600"}  # the checked rank runs ~30x slower
        cmd = [python, __file__, "--worker"]
        if rank == args.rank:
            env["PYTHONMALLOC"] = "malloc"  # every Python object through the checked malloc
            cmd = [valgrind, "--tool=memcheck", "--error-limit=no", "--num-callers=30",
                   f"--log-file={args.log / f'rank{rank}.valgrind'}", *cmd]
        out = open(args.log / f"rank{rank}.out", "w")  # noqa: SIM115 (closed below)
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out,
                                       stderr=subprocess.STDOUT), out))
    codes = []
    for proc, out in procs:
        codes.append(proc.wait())
        out.close()
    log = (args.log / f"rank{args.rank}.valgrind").read_text(errors="replace")
    misuse = heap_misuse(log)
    for kind, count in sorted(summary(log).items(), key=lambda kv: -kv[1]):
        print(f"{count:6d}  {kind}")
    print(f"exit codes {codes}; heap misuse reports: {len(misuse)} "
          f"(log: {args.log / f'rank{args.rank}.valgrind'})")
    for block in misuse[:5]:
        print("\n".join(block[:12]), "\n")
    return 1 if misuse or any(codes) else 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        _worker()
    else:
        sys.exit(main())
