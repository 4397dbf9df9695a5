"""From a killed rank to the first step after the restart, by part.

Runs the GPT recipe under ``torchrun --standalone --nproc-per-node 2 --max-restarts 1`` with
``trainer.kill_at=[1,STEP]`` and ``trainer.resume_from=auto``, and reads the times of the log
lines both attempts write (the recipe's, and torchrun's own): the kill, torchrun seeing the
failed worker, the new attempt's first line (a fresh interpreter: imports, the process group,
the config), its set-up up to the checkpoint load (data, model, optimizer), the load itself, and
its first training step. The goal is a restart that costs the checkpoint load plus the restart
and nothing more.

    python benchmarks/restart_time.py                       # the recipe's default GPT
    python benchmarks/restart_time.py model.d_model=768 model.n_layer=12   # ~150 M parameters
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KILL_STEP, CHECKPOINT_EVERY = 6, 4
_HYDRA = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]\[[^\]]+\]\[\w+\] - (.*)$")
_TORCHRUN = re.compile(r"^[EWI](\d{4}) (\d\d:\d\d:\d\d\.\d+) \d+ .*\] (.*)$")


def _events(text: str, year: int) -> list[tuple[float, str]]:
    """(seconds since the epoch, message) of every timestamped line, in order."""
    out = []
    for line in text.splitlines():
        if m := _HYDRA.match(line):
            at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
            out.append((at.timestamp(), m.group(2)))
        elif m := _TORCHRUN.match(line):
            at = datetime.strptime(f"{year}{m.group(1)} {m.group(2)}", "%Y%m%d %H:%M:%S.%f")
            out.append((at.timestamp(), m.group(3)))
    return out


def _first(events: list[tuple[float, str]], pattern: str, after: float = 0.0) -> float:
    for at, message in events:
        if at >= after and re.search(pattern, message):
            return at
    raise SystemExit(f"no log line matching {pattern!r} after {after}: the run did not go as "
                     f"planned")


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="restart_bench_") as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", "--max-restarts=1", str(ROOT / "recipes" / "train.py"),
               f"trainer.max_steps={KILL_STEP + 2}", f"trainer.checkpoint_every={CHECKPOINT_EVERY}",
               f"trainer.kill_at=[1,{KILL_STEP}]", "trainer.resume_from=auto",
               "trainer.log_every=1", "trainer.progress_bar=false", f"hydra.run.dir={tmp}/run",
               *sys.argv[1:]]
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                           os.environ.get("PYTHONPATH")]))}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    printed = proc.stdout + proc.stderr
    if proc.returncode:
        raise SystemExit(f"the run failed:\n{printed[-3000:]}")
    events = sorted(_events(printed, datetime.now().year))
    killed = _first(events, r"kills itself \(SIGKILL\)")
    seen = _first(events, r"failed \(exitcode: -9\)", killed)
    started = _first(events, r"^config: ", seen)
    planned = _first(events, r"^memory plan per rank", started)
    loaded = _first(events, r"^resumed from .* at step", planned)
    stepped = _first(events, rf"^step {CHECKPOINT_EVERY + 1} ", loaded)
    parts = [("torchrun sees the dead rank and stops the other", seen - killed),
             ("new workers: interpreter, imports, process group, config", started - seen),
             ("set-up: data, model, optimizer", planned - started),
             ("checkpoint load", loaded - planned),
             ("first step after the restart", stepped - loaded)]
    lost = KILL_STEP - 1 - CHECKPOINT_EVERY
    print(f"kill at step {KILL_STEP}, last checkpoint step {CHECKPOINT_EVERY} ({lost} step(s) "
          f"to train again)\n| part | seconds |\n|---|---:|")
    for name, seconds in parts:
        print(f"| {name} | {seconds:.2f} |")
    print(f"| **kill to first step** | **{stepped - killed:.2f}** |")


if __name__ == "__main__":
    main()
