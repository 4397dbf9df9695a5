"""The pooled test ranks (``rank_pool.py``) never hand a test a process where an earlier test's
process group is still alive: such a group's gloo threads and sockets outlive the test that made
it, and a later test would run beside them. And the port a test's rank 0 binds later is one the
kernel hands nobody else meanwhile."""

from __future__ import annotations

import os
import socket

import pytest
import torch.distributed as dist

import parallel
from distributed import _ephemeral_ports, free_port, run_ranks
from rank_pool import FRESH_ENV, gloo_threads

_KEPT: list = []  # what a careless task leaves behind in its process


def _leak_a_group(rank: int, world: int) -> int:
    parallel.init()
    _KEPT.append(dist.new_group([0, 1]))  # destroy() cannot free what is still held here
    return os.getpid()


def _look(rank: int, world: int) -> tuple[int, list[str]]:
    return os.getpid(), gloo_threads()


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get(FRESH_ENV) == "1", reason="pooling is off")
def test_a_rank_left_with_a_live_group_takes_no_other_test():
    leaked = run_ranks(_leak_a_group, 2)
    after = run_ranks(_look, 2)
    assert {pid for pid, _ in after}.isdisjoint(leaked)  # new processes ran the next test
    assert all(threads == [] for _, threads in after)
    again = run_ranks(_look, 2)
    assert [pid for pid, _ in again] == [pid for pid, _ in after]  # and they stay pooled


def _patch_and_leave(rank: int, world: int) -> None:
    import foundation.device as hd

    dist.all_reduce = lambda *args, **kwargs: None  # a careless test's stand-in, not restored
    hd.gathers_chunkwise = lambda backend: False


def _real_functions(rank: int, world: int) -> tuple[int, bool]:
    import foundation.device as hd

    return os.getpid(), dist.all_reduce.__name__ == "all_reduce" and hd.gathers_chunkwise("gloo")


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get(FRESH_ENV) == "1", reason="pooling is off")
def test_a_task_that_leaves_a_function_replaced_fails_and_the_next_gets_the_real_one():
    # test_sharded_reduce_ops left foundation.device.gathers_chunkwise replaced in its pooled
    # ranks, and test_resharded, next on them, got FSDP2 in place of the level3 it tests
    with pytest.raises(AssertionError, match=r"the task left \['torch.distributed.all_reduce', "
                                             r"'foundation.device.gathers_chunkwise'\] replaced"):
        run_ranks(_patch_and_leave, 2)
    before = run_ranks(_real_functions, 2)
    assert all(real for _, real in before)
    assert [pid for pid, _ in run_ranks(_real_functions, 2)] == [pid for pid, _ in before]


def test_a_rank_zero_port_is_free_and_outside_the_range_the_kernel_hands_out():
    # gloo's listening sockets and every outgoing connection draw ports from the ephemeral
    # range: a port picked there can be taken before rank 0 binds it (CI: EADDRINUSE)
    ephemeral = _ephemeral_ports()
    ports = [free_port() for _ in range(20)]
    if ephemeral.start > 10000:
        assert not any(port in ephemeral for port in ports)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("", port))
