"""What ``make device-check``'s steps share: a table row, the check's clock, running a command
or a recipe run from the repository root and reading back its figures and losses."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: the recipe's model and corpus for the check's runs: what they check (a device against the
#: host, a resume, a layout against one device) needs steps, not size
SMALL = ("model.n_layer=2", "model.d_model=64", "model.n_head=2", "data.num_chars=100000")
#: the recipe's loss on the accelerator against the CPU's: 16-bit weights round differently
TOLERANCE = {"fp32": 1e-3, "bf16": 3e-2}


@dataclasses.dataclass
class Row:
    step: str
    result: str  # PASS, FAIL or SKIP
    detail: str
    seconds: float = 0.0


class Budget:
    """What is left of the check's seconds."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())


def run_command(cmd: list[str], timeout: float, env: dict[str, str] | None = None
                ) -> tuple[int, str, float]:
    """(exit code, the output's tail, seconds) of ``cmd`` run from the repository root."""
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              timeout=max(timeout, 1.0),
                              env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
        code, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as err:
        partial = err.stdout.decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        code, out = 124, f"timed out after {timeout:.0f} s\n{partial}"
    return code, out[-6000:], time.perf_counter() - start


def torchrun(ranks: int) -> list[str]:
    """The command that starts ``ranks`` processes of a script on this node."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={ranks}"]


def last_line(text: str, *keys: str) -> str:
    """The last line of ``text`` naming one of ``keys`` with a figure in it (a table's header
    names them too, without a number), else the last line; a command stopped at its time
    limit says so (run_command's first line)."""
    if text.startswith("timed out after"):
        return text.splitlines()[0]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    hits = [ln for ln in lines if any(k in ln for k in keys)
            and any(c.isdigit() for c in ln)] or lines
    return hits[-1][:200] if hits else ""


def skip_without_device(name: str, has_device: bool) -> Row | None:
    return None if has_device else Row(name, "SKIP", "no accelerator on this machine")


def recipe_run(run_dir: Path, steps: int, timeout: float, *overrides: str, ranks: int = 1
               ) -> tuple[int, dict[int, float], float, str]:
    """(exit code, step -> loss, seconds, output) of the GPT recipe for ``steps`` steps into
    ``run_dir``, on ``ranks`` processes (``parallel=none`` unless an override names one)."""
    mode = () if any(o.startswith("parallel=") for o in overrides) else ("parallel=none",)
    overrides = (*SMALL, *overrides)
    launcher = torchrun(ranks) if ranks > 1 else [sys.executable]
    code, out, secs = run_command([*launcher, "recipes/train.py", f"trainer.max_steps={steps}",
                                   "trainer.progress_bar=false", f"hydra.run.dir={run_dir}",
                                   *mode, *overrides], timeout)
    return code, losses_in(run_dir), secs, out


def losses_in(run_dir: Path) -> dict[int, float]:
    """Step -> loss of a recipe run's ``metrics.jsonl``."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return {}
    rows = (json.loads(line) for line in metrics.read_text().splitlines())
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def table(rows: list[Row]) -> str:
    lines = ["| step | result | figures | s |", "| --- | --- | --- | --- |"]
    lines += [f"| {r.step} | {r.result} | {r.detail.replace('|', '/')} | {r.seconds:.0f} |"
              for r in rows]
    return "\n".join(lines) + "\n"
