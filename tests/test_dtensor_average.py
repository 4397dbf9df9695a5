"""DTensor's pending averages on a backend without ``ReduceOp.AVG`` (HCCL): ``parallel.init``
has them reduced as a sum and a divide (``foundation.compat.reduce_dtensor_averages_by_sum``).
On 2 gloo ranks with the backend query answering as HCCL would, a mean over a sharded dimension
issues a sum and gives the same values; answering as gloo, torch's average runs unchanged."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

import foundation.device as hd
import parallel
from distributed import run_ranks
from parallel.dims import build_mesh


class ReduceOps(TorchDispatchMode):
    """The reduce op of every functional all_reduce / reduce_scatter issued."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and "reduce" in func.__name__:
            self.ops.append(str(args[1]))
        return func(*args, **(kwargs or {}))


def _means(rank: int, world: int) -> dict:
    parallel.init()
    mesh = build_mesh((world,), ("dp",))
    whole = torch.arange(24.0).reshape(8, 3)
    out = {}
    for lacks in (False, True):
        hd._AVG_BACKENDS, kept = (frozenset() if lacks else hd._AVG_BACKENDS), hd._AVG_BACKENDS
        try:
            with ReduceOps() as seen:
                mean = distribute_tensor(whole, mesh, [Shard(0)]).mean(0).full_tensor()
                rows = distribute_tensor(whole, mesh, [Shard(1)]).mean(1).full_tensor()
        finally:
            hd._AVG_BACKENDS = kept
        out[lacks] = {"ops": seen.ops, "mean": mean, "rows": rows}
    return out


def test_a_backend_without_avg_reduces_dtensor_means_as_a_sum():
    whole = torch.arange(24.0).reshape(8, 3)
    for result in run_ranks(_means, 2):
        assert "avg" in result[False]["ops"]               # torch's own on gloo
        assert result[True]["ops"] and "avg" not in result[True]["ops"]
        for lacks in (False, True):
            torch.testing.assert_close(result[lacks]["mean"], whole.mean(0))
            torch.testing.assert_close(result[lacks]["rows"], whole.mean(1))
