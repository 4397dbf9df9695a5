"""Launch the training recipe the way a user does and read back what it logged.

Shared by every recipe test: ``run_recipe`` runs ``recipes/train.py`` under torchrun (``nproc``
ranks) or as a plain ``python`` process with a tiny model, and ``losses_of`` reads the
``metrics.jsonl`` it wrote (checking that each step was logged once, by rank 0).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
TINY = ["model.d_model=32", "model.n_layer=1", "model.n_head=2", "data.num_chars=100000",
        "data.global_batch_size=8", "optim.warmup_steps=2", "optim.lr=1e-2",
        "trainer.progress_bar=false"]


def run_recipe(args: list[str], nproc: int | None, run: Path, cache: Path,
               timeout: float = 150) -> subprocess.CompletedProcess:
    """Run the recipe with ``TINY`` + ``args`` into run dir ``run``; assert it succeeded."""
    launcher = [sys.executable]
    if nproc is not None:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = launcher + [str(RECIPES / "train.py"), *TINY, f"data.cache_dir={cache}",
                      f"hydra.run.dir={run}", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def losses_of(run: Path) -> dict[int, float]:
    """step -> loss from the run's metrics.jsonl (each step must appear once)."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), "a step was logged twice (by two ranks?)"
    return {r["step"]: r["loss"] for r in records}
