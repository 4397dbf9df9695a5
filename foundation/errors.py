"""``CollectiveError``: one error, naming the collective and the rank, for every failed exchange.

A peer that dies surfaces in gloo as ``Connection closed/reset by peer``, a stalled one as a
timeout, a collective called with different shapes (in the checking mode of ``parallel.init``) as
torch's fingerprint mismatch; NCCL and HCCL have texts of their own. :func:`collective_guard`
turns all of these into :class:`CollectiveError` wherever this project issues collectives (the
differentiable collectives, the gradient reducer's buckets, ``DataParallel``'s wrap-time checks,
semi-auto forward passes, the recipe loop), with the backend's text kept at the end.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

_BACKEND_FAILURE = re.compile(
    r"gloo|nccl|hccl|connection (closed|reset) by peer|timed out|"
    r"detected mismatch between collectives|broken pipe", re.IGNORECASE)
_FINGERPRINT = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\("
                          r"[^)]*?OpType=(\w+), TensorShape=\[([^\]]*)\]")


class CollectiveError(RuntimeError):
    """A collective failed: usually a peer rank died, or stopped calling the same collectives."""


def is_collective_failure(err: BaseException) -> bool:
    """Whether ``err`` comes from a communication backend rather than from ordinary code."""
    if isinstance(err, (CollectiveError, dist.DistError)):
        return True
    # the backends raise plain RuntimeErrors; a subclass is some library's own error. DCP
    # gathers each rank's failure into a CheckpointException (a BaseException) whose text
    # holds the backend's.
    plain = type(err) is RuntimeError or isinstance(err, CheckpointException)
    return plain and bool(_BACKEND_FAILURE.search(str(err)))


def _mismatch(text: str) -> str | None:
    """"rank 0 called ALLREDUCE with shape (4,), rank 1 with shape (5,)" from torch's text."""
    found = _FINGERPRINT.findall(text)
    if len(found) < 2:
        return None
    parts = [f"rank {rank} called {op} with shape ({shape}{',' if shape.isdigit() else ''})"
             for rank, op, shape in found[:2]]
    return "the ranks called different collectives: " + "; ".join(parts)


def _rank_and_size(group: dist.ProcessGroup | None) -> tuple[str, str]:
    if not dist.is_initialized():
        return "?", "?"
    return str(dist.get_rank()), str(dist.get_world_size(group))


@contextmanager
def collective_guard(what: str, group: dist.ProcessGroup | None = None, *,
                     only_backend_errors: bool = False) -> Iterator[None]:
    """Raise :class:`CollectiveError` naming ``what`` and this rank for a failure inside.

    With ``only_backend_errors`` (a block that runs ordinary code too, e.g. a training step),
    only errors that come from a communication backend are converted; others pass unchanged.
    """
    try:
        yield
    except CollectiveError as err:
        if what in str(err):
            raise
        # an inner exchange failed (a reducer bucket inside a training step): say where, too
        raise CollectiveError(f"{what}: {err}") from err
    except (RuntimeError, CheckpointException) as err:  # gloo reports a dead peer as a
        # RuntimeError, NCCL as DistError, a checkpoint save or load as DCP's CheckpointException
        if (only_backend_errors or isinstance(err, CheckpointException)) and \
                not is_collective_failure(err):
            raise
        rank, size = _rank_and_size(group)
        cause = _mismatch(str(err)) or ("the usual cause is a peer rank that died, timed out, "
                                        "or called a different collective")
        raise CollectiveError(
            f"{what} failed on rank {rank} of {size}; {cause} — check the other ranks' logs. "
            f"({type(err).__name__}: {err})"
        ) from err
