"""The pipeline × expert paths on 4 gloo ranks, run again and again under glibc's heap checks.

A full suite once saw a rank of ``test_expert_combinations.py``'s spawn abort in these cases with
``malloc(): unaligned tcache chunk detected`` (a write into freed memory; issue 44). Where memory
can be corrupted, a wrong value without any error is possible too, so here each rank runs the
four pipeline cases (1F1B and ZBV schedules, expert, data and optimizer parallel: torch's P2P
sends and receives, the MoE all-to-alls, the bucketed reducer, FSDP2 on gloo) ``REPEATS`` times
in one process with every block of its heap pattern-filled when allocated and freed and, where
glibc's debugging malloc is installed, every ``malloc``/``free`` checked
(``distributed.glibc_heap_checks``): a rank that corrupts its heap dies naming the check (and
prints every thread's Python stack), and one that reads freed or unwritten memory computes other
losses than its first repeat.
"""

from __future__ import annotations

import pytest

import parallel
from distributed import glibc_heap_checks, run_ranks
from test_expert_combinations import CASES
from torch_features import runs_here

PIPELINE_CASES = [name for name in CASES if name.startswith("pp2") and runs_here(name)]
REPEATS = 4


def _repeated(rank: int, world: int, repeats: int) -> list[dict[str, list[float]]]:
    parallel.init()
    runs = []
    for _ in range(repeats):
        runs.append({name: CASES[name][0](CASES[name][1])[0] for name in PIPELINE_CASES})
    return runs


@pytest.mark.slow
def test_pipeline_expert_steps_repeat_bitwise_under_heap_checks():
    spawned = run_ranks(_repeated, 4, REPEATS, timeout=400, env=glibc_heap_checks())
    assert len(PIPELINE_CASES) == (4 if runs_here("zbv") else 3)
    for rank, runs in enumerate(spawned):
        first = runs[0]
        for again in runs[1:]:
            assert again == first, f"rank {rank}: a repeat of the same steps gave other losses"
