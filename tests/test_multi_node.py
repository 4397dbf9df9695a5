"""Two torchrun agents on this host, as two nodes of 2 ranks each (``--nnodes 2``, c10d
rendezvous on 127.0.0.1): the 3-D hybrid recipe (2 pipeline stages × 2-way tensor parallel)
trains with the losses of the same layout launched standalone on 4 ranks, its tensor groups
inside a node and its stages across them, and every rank writes into one run directory although
the agents started at different times (each names the run after its own start)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from distributed import free_port
from recipe_helpers import RECIPES, TINY, losses_of, recipe_env, run_recipe

HYBRID = ["parallel=hybrid_3d", "model.n_layer=2", "trainer.max_steps=4"]


def _agent(cwd: Path, port: int, args: list[str], out: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two-nodes",
           str(RECIPES / "train.py"), *args]
    with open(out, "w") as sink:
        return subprocess.Popen(cmd, cwd=cwd, stdout=sink, stderr=subprocess.STDOUT,
                                env=recipe_env(OMP_NUM_THREADS="1",
                                               HETERO_PARALLEL_ACCELERATOR="none"))


@pytest.mark.slow
def test_two_agents_train_like_one_standalone_launch(tmp_path):
    cache = tmp_path / "cache"
    standalone = tmp_path / "standalone"
    run_recipe(HYBRID, 4, standalone, cache)
    args = [*TINY, *HYBRID, f"data.cache_dir={cache}"]  # no run dir: each agent names its own
    port = free_port()
    logs = [tmp_path / "agent0.log", tmp_path / "agent1.log"]
    first = _agent(tmp_path, port, args, logs[0])
    time.sleep(1.5)  # the second node's agent starts in another second: another run dir name
    agents = [first, _agent(tmp_path, port, args, logs[1])]
    try:
        codes = [agent.wait(timeout=400) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    printed = "\n".join(log.read_text() for log in logs)
    assert codes == [0, 0], printed[-4000:]
    runs = [p.parent for p in (tmp_path / "outputs").rglob("metrics.jsonl")]
    assert len(runs) == 1, f"the ranks wrote {len(runs)} run directories: {runs}"
    assert losses_of(runs[0]) == losses_of(standalone)  # bit for bit: the same collectives
    assert "2 nodes × 2 ranks; inside a node: tp; across nodes: pp (2 nodes)" in printed
