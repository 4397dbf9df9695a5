"""Elastic shrink: a job of two torchrun agents (two "nodes" of 2 ranks, ``--nnodes 1:2``) loses
one node mid-run (``trainer.kill_scope=node``: the agent and its workers SIGKILLed); the agent
left restarts its workers, the rendezvous closes with one node, and the job continues on 2 ranks
from the last checkpoint (DCP reshards the 4-rank checkpoint). Its losses equal those of a run
resumed from that checkpoint on 2 ranks by hand."""

from __future__ import annotations

import subprocess
import sys

import pytest

from distributed import free_port
from recipe_helpers import RECIPES, TINY, losses_of, recipe_env, run_recipe

STEPS = ["trainer.max_steps=8", "trainer.checkpoint_every=4"]


@pytest.mark.slow
def test_a_job_that_loses_a_node_continues_on_the_node_left(tmp_path):
    cache, run = tmp_path / "cache", tmp_path / "elastic"
    args = [*TINY, *STEPS, f"data.cache_dir={cache}", f"hydra.run.dir={run}",
            "trainer.resume_from=auto", "trainer.kill_at=[2,6]", "trainer.kill_scope=node"]
    port = free_port()
    # the rendezvous store in a process of its own, as on a cluster whose store outlives any
    # node: with the store inside one agent (torchrun's default), losing that node ends the job
    store = subprocess.Popen(
        [sys.executable, "-c", "import time, torch.distributed as d; s = d.TCPStore("
         f"'127.0.0.1', {port}, is_master=True, wait_for_workers=False); print('up', flush=True)"
         "; time.sleep(900)"], stdout=subprocess.PIPE, text=True)
    assert store.stdout is not None and store.stdout.readline().strip() == "up"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic",
           # the first rendezvous waits for both agents: one that starts over 2 s after the
           # other on a loaded host (importing torch) found a round of one node closed, joined
           # the next, and that round's bootstrap hung both agents on store waits (CI under
           # three test workers); the survivor's round then waits as long, idle
           "--rdzv-conf=keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=20",
           "--max-restarts=1", str(RECIPES / "train.py"), *args]
    env = recipe_env(OMP_NUM_THREADS="1", HETERO_PARALLEL_ACCELERATOR="none")
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    agents = []
    for log in logs:  # each agent its own process group: a "node" that can be lost whole
        with open(log, "w") as sink:
            agents.append(subprocess.Popen(cmd, cwd=tmp_path, stdout=sink,
                                           stderr=subprocess.STDOUT, env=env,
                                           start_new_session=True))
    try:
        codes = sorted(agent.wait(timeout=400) for agent in agents)
    finally:
        for process in (*agents, store):
            if process.poll() is None:
                process.kill()
            process.wait()
    printed = "\n".join(log.read_text() for log in logs)
    assert codes == [-9, 0], printed[-4000:]  # the lost node's agent, the one that finished
    assert "rank 2 kills its node (SIGKILL) as step 6 begins" in printed
    assert f"resumed from {run / 'checkpoints' / 'step_000004'} at step 4" in printed
    assert "2 rank(s) on cpu" in printed  # the second attempt: one node left
    by_hand = tmp_path / "by_hand"
    run_recipe([*STEPS, f"trainer.resume_from={run / 'checkpoints' / 'step_000004'}"], 2,
               by_hand, cache)
    elastic = losses_of(run)
    assert sorted(elastic) == list(range(1, 9))
    assert {s: elastic[s] for s in range(5, 9)} == pytest.approx(losses_of(by_hand), rel=1e-6)
