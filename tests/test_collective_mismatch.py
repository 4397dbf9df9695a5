"""Mismatched collectives are named on every rank, before any data moves, in both modes.

Before the signature check, an all_reduce of shapes [2, 3] against [3, 2] returned on both ranks
with different-shaped results, and in check mode an all_gather of [2] against [3] left one rank
with uninitialised memory while gloo aborted the other. One spawn of 2 gloo ranks runs every case
in the default mode, then again in check mode, then checks the group still works.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

import parallel
from foundation import collective_check
from parallel import collectives
from tests.distributed import run_ranks

_CASES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "different_op")


def _call(name: str, rank: int) -> None:
    if name == "all_reduce":  # same element count: gloo itself would not notice
        collectives.all_reduce(torch.ones(2, 3) if rank == 0 else torch.ones(3, 2))
    elif name == "all_gather":
        collectives.all_gather(torch.ones(2 + rank))
    elif name == "reduce_scatter":
        collectives.reduce_scatter(torch.ones(4 + 2 * rank))
    elif name == "all_to_all":
        collectives.all_to_all(torch.ones(4, 1 + rank))
    elif name == "broadcast":
        collectives.broadcast(torch.ones(3, dtype=torch.float64 if rank == 0 else torch.float32))
    elif name == "different_op":
        (collectives.all_reduce if rank == 0 else collectives.all_gather)(torch.ones(5))
    elif name == "rows":  # rank 0 sends 2 rows to rank 1, which expects 1 or 2
        collectives.all_to_all_rows(torch.ones(3, 2), [1, 2], [1, 1 + rank])


def _outcomes(rank: int) -> dict[str, str]:
    found = {}
    for name in _CASES:
        try:
            _call(name, rank)
            found[name] = "no error"
        except parallel.CollectiveError as err:
            found[name] = str(err)
    return found


def _both_modes(rank: int, world: int) -> dict[str, dict[str, str] | list[float]]:
    parallel.init(timeout=20)
    default = _outcomes(rank)
    default_ok = collectives.all_reduce(torch.ones(2)).tolist()
    # MoE dispatch: each rank's row count differs, and a count one rank has seen is new to the
    # other; the default mode's cache must not let one rank skip the check the other runs (a
    # hang before the row count left the cache key)
    got = []
    for step in range(4):
        counts = (step % 2 + 1, step % 3 + 1)  # at step 2: rank 0 repeats 1, rank 1 is new at 3
        mine, theirs = counts[rank], counts[1 - rank]
        rows = torch.full((2 * mine, 2), float(rank))
        out = collectives.all_to_all_rows(rows, [mine, mine], [mine if rank == 0 else theirs,
                                                               theirs if rank == 0 else mine])
        got.append(int(out.shape[0]))
    default_ok.append(float(len(got)))
    parallel.destroy()
    parallel.init(timeout=20, check_collectives=True)
    checked = _outcomes(rank)
    try:
        _call("rows", rank)
        checked["rows"] = "no error"
    except parallel.CollectiveError as err:
        checked["rows"] = str(err)
    checked_ok = collectives.all_reduce(torch.ones(2)).tolist()
    # data on an accelerator, the meta device standing in (no value of it can be read): the
    # signature travels over the group's host backend, so the check reads nothing back
    on_device = []
    for shape in ((4,), (4,) if rank == 0 else (5,)):
        try:
            collective_check.check("all_reduce", torch.empty(shape, device="meta"), what="x")
            on_device.append("agreed")
        except parallel.CollectiveError as err:
            on_device.append(str(err))
    parallel.destroy()
    return {"default": default, "check": checked, "after": [*default_ok, *checked_ok],
            "on_device": on_device}


@pytest.fixture(scope="module")
def outcomes():
    # fresh ranks: the task tears its process group down and makes another on the same
    # MASTER_PORT; in a pooled rank the first store once still answered the second rendezvous
    # (rank 1: "Failed to recv, got 0 bytes", 1 of 2 full runs)
    return run_ranks(_both_modes, 2, timeout=180, fresh=True)


_SHOWN = {
    "all_reduce": ("all_reduce float32 [2, 3]", "all_reduce float32 [3, 2]"),
    "all_gather": ("all_gather float32 [2]", "all_gather float32 [3]"),
    "reduce_scatter": ("reduce_scatter float32 [4]", "reduce_scatter float32 [6]"),
    "all_to_all": ("all_to_all float32 [4, 1]", "all_to_all float32 [4, 2]"),
    "broadcast": ("broadcast float64 [3]", "broadcast float32 [3]"),
    "different_op": ("all_reduce float32 [5]", "all_gather float32 [5]"),
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["default", "check"])
@pytest.mark.parametrize("case", _CASES)
def test_every_rank_names_the_mismatch(outcomes, mode, case):
    rank0, rank1 = _SHOWN[case]
    for rank, found in enumerate(outcomes):
        message = found[mode][case]
        assert "the ranks called mismatched collectives" in message, message
        assert f"caught on rank {rank} before any data moved" in message
        assert f"rank 0: {rank0}" in message and f"rank 1: {rank1}" in message
        assert "Ranks [1] differ from rank 0" in message


@pytest.mark.slow
def test_split_sizes_are_checked_in_check_mode(outcomes):
    for found in outcomes:
        assert "all_to_all_rows: the ranks disagree on the split sizes" in found["check"]["rows"]
        assert "rank 0 sends 2 rows to rank 1, which expects 1" in found["check"]["rows"]


@pytest.mark.slow
def test_a_signature_of_device_data_travels_on_the_host(outcomes):
    for found in outcomes:
        agreed, mismatch = found["on_device"]
        assert agreed == "agreed"
        assert "rank 0: all_reduce float32 [4]" in mismatch
        assert "rank 1: all_reduce float32 [5]" in mismatch


@pytest.mark.slow
def test_the_group_still_works_after_a_caught_mismatch(outcomes):
    assert [found["after"] for found in outcomes] == [[2.0, 2.0, 4.0, 2.0, 2.0]] * 2


def test_one_rank_checks_nothing_and_check_mode_follows_init():
    parallel.init(check_collectives=True)
    try:
        assert collective_check.enabled()
        assert collectives.all_reduce(torch.ones(2, 3)).shape == (2, 3)
    finally:
        parallel.destroy()
    assert not collective_check.enabled()  # $HETERO_PARALLEL_CHECK_COLLECTIVES unset here


def test_a_signature_describes_the_call():
    row = collective_check._encode("all_to_all_rows", "x", torch.ones(3, 2, dtype=torch.bfloat16),
                                   (), (0,), (3, 2))
    assert collective_check._describe(row.tolist()) == "all_to_all_rows bfloat16 [*, 2]"
    big = collective_check._encode("all_reduce", "x", torch.ones(()), (7,), (), (2,) * 10)
    assert collective_check._describe(big.tolist()) == (
        "all_reduce float32 [2, 2, 2, 2, 2, 2, 2, 8] params [7, 0, 0, 0]")


def test_another_backend_after_a_gloo_group_is_refused_naming_both():
    parallel.init("gloo")
    try:
        assert dist.get_backend() == "gloo"
        with pytest.raises(ValueError, match=r"backend='nccl'.*already initialised with backend "
                                             r"'[^']*gloo"):
            parallel.init("nccl")
        parallel.init("gloo")  # asking for what is there stays a no-op
    finally:
        parallel.destroy()


def test_an_inner_collective_error_gains_the_training_step():
    parallel.init()
    try:
        with pytest.raises(parallel.CollectiveError,
                           match=r"^training step 7: DataParallel gradient all_reduce failed"):
            with parallel.errors.collective_guard("training step 7", only_backend_errors=True):
                raise parallel.CollectiveError("DataParallel gradient all_reduce failed on rank 0")
    finally:
        parallel.destroy()


def test_a_peer_lost_inside_a_checkpoint_save_names_the_step():
    """DCP gathers a dead peer's "Connection reset" into a CheckpointException (a BaseException
    that the step guard used to let through unnamed)."""
    try:
        raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Connection reset by peer")
    except RuntimeError as err:
        failure = CheckpointException("save", {1: _wrap_exception(err)})
    parallel.init()
    try:
        with pytest.raises(parallel.CollectiveError, match=r"^training step 4 failed on rank 0"):
            with parallel.errors.collective_guard("training step 4", only_backend_errors=True):
                raise failure
        with pytest.raises(CheckpointException):  # not a backend failure: passes unchanged
            with parallel.errors.collective_guard("training step 4", only_backend_errors=True):
                raise CheckpointException("save", {})
    finally:
        parallel.destroy()
