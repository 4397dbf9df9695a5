"""GradReducer on the paths accelerators take (issue 24), emulated on CPU ranks over gloo.

* sparse gradients: NCCL and HCCL have no sparse all_reduce, so the reducer all-gathers indices
  and values where the backend lacks one; forced here on gloo, it must equal gloo's own sparse
  all_reduce and torch DDP.
* hooks from two threads (host parameters on autograd's CPU thread, device ones on the device
  thread): each bucket is launched once and the step finished once.
* no host<->device traffic for bookkeeping: no per-parameter flag writes into the buckets, no
  reads of them back to the host.
* buckets follow a recast: after OffloadAdamW casts the model to bf16, gradients travel in bf16;
  and a move: after parameter offload rests the weights on the host, they are reduced there.
"""

from __future__ import annotations

import copy
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import parallel
import parallel.data.grad_reducer as grad_reducer
from distributed import run_ranks
from foundation import device as hd
from hetero.optim import OffloadAdamW
from parallel.data.grad_reducer import GradReducer


class Net(nn.Module):
    """Four layers, one never used (its gradient must stay None)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 1)
        self.never = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def _batch(rank: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(4, 8, generator=g).to(dtype), torch.randn(4, 1, generator=g).to(dtype)


class _AllReduceLog:
    """Wraps ``dist.all_reduce`` to record each call's tensor (all of them still go through),
    optionally taking ``delay`` seconds to launch, as a device collective's launch does (other
    threads run meanwhile)."""

    def __init__(self, delay: float = 0.0) -> None:
        self.calls: list[torch.Tensor] = []
        self.delay = delay
        self._real = dist.all_reduce
        self._lock = threading.Lock()

    def __call__(self, tensor: torch.Tensor, *args, **kwargs):
        with self._lock:
            self.calls.append(tensor)
        if self.delay:
            time.sleep(self.delay)
        return self._real(tensor, *args, **kwargs)


# ------------------------------------------------------------------ 1. sparse without sparse ops


def test_sparse_all_reduce_capability_by_backend():
    assert hd.supports_sparse_all_reduce("gloo")
    assert not hd.supports_sparse_all_reduce("nccl")
    assert not hd.supports_sparse_all_reduce("hccl")
    parallel.init()
    assert hd.group_backend(None, torch.device("cpu")) == "gloo"


def test_sparse_gather_must_be_a_bool_or_none():
    parallel.init()
    with pytest.raises(TypeError, match="sparse_gather must be True, False or None"):
        GradReducer([nn.Parameter(torch.ones(2))], mean=True, cap_bytes=1024, group=None,
                    sparse_gather="yes")


def _sparse_grads(rank: int, world: int, mean: bool, gather: bool | None,
                  used_by: tuple[int, ...]) -> tuple[torch.Tensor | None, int]:
    """A sparse table's gradient reduced by a GradReducer (``gather`` forces the all-gather
    fallback); also how many sparse tensors went to ``dist.all_reduce``."""
    torch.manual_seed(0)
    table = nn.Embedding(30, 3, sparse=True)
    reducer = GradReducer(table.parameters(), mean=mean, cap_bytes=2**20, group=None,
                          sparse_params=table.parameters(), sparse_gather=gather)
    log = _AllReduceLog()
    dist.all_reduce = log
    try:
        ids = torch.randint(0, 30, (5 + 3 * rank,), generator=torch.Generator().manual_seed(rank))
        if rank in used_by:
            table(ids).pow(2).sum().backward()
        else:  # the table takes no part in this rank's backward
            (torch.ones(1, requires_grad=True) * 2).sum().backward()
            reducer.reduce_accumulated()
    finally:
        dist.all_reduce = log._real
        reducer.remove()
    grad = table.weight.grad
    return (None if grad is None else grad.to_dense()), sum(t.is_sparse for t in log.calls)


def _sparse_vs_ddp(rank: int, world: int) -> torch.Tensor:
    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Embedding(30, 3, sparse=True))
    ids = torch.randint(0, 30, (5 + 3 * rank,), generator=torch.Generator().manual_seed(rank))
    ddp(ids).pow(2).sum().backward()
    return ddp.module.weight.grad.to_dense()


def _undeclared_sparse(rank: int, world: int) -> dict:
    """A table whose gradient turns out sparse on rank 0 and is missing on rank 1, beside a
    dense layer, nothing declared: the usage flags ride in the last (host, FP32) bucket."""
    torch.manual_seed(0)
    table, dense = nn.Embedding(30, 3, sparse=True), nn.Linear(3, 1)
    reducer = GradReducer([*table.parameters(), *dense.parameters()], mean=True,
                          cap_bytes=2**20, group=None)
    ids = torch.randint(0, 30, (5,), generator=torch.Generator().manual_seed(7))
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(rank))
    out = dense(x).sum() + (table(ids).pow(2).sum() if rank == 0 else 0)
    out.backward()
    reducer.remove()
    return {"flags in a bucket": reducer._flags_in is not None,
            "table": table.weight.grad.to_dense(), "dense": dense.weight.grad.clone()}


def _sparse_suite(rank: int, world: int) -> dict:
    out = {"undeclared": _undeclared_sparse(rank, world)}
    for mean in (True, False):
        for used_by in ((0, 1), (0,)):
            gathered, sparse_calls = _sparse_grads(rank, world, mean, True, used_by)
            native, native_calls = _sparse_grads(rank, world, mean, False, used_by)
            out[(mean, used_by)] = (gathered, native, sparse_calls, native_calls)
    out["auto_on_gloo"] = _sparse_grads(rank, world, True, None, (0, 1))[1]
    out["ddp"] = _sparse_vs_ddp(rank, world)
    return out


# ------------------------------------------------------------------ 6. hooks from two threads


def _threaded_step(reducer: GradReducer, grads: dict[int, torch.Tensor],
                   log: _AllReduceLog) -> tuple[list[int], int]:
    """Fire ``reducer``'s hook from two threads at once (each bucket's two parameters from
    different threads, in launch order); return the launches per bucket and how many
    end-of-backward callbacks were queued."""
    callbacks = []
    for p in reducer.params:
        p.grad = grads[id(p)].clone()
    order = [p for bucket in reducer.buckets for p in bucket.params]  # launch order
    halves = (order[0::2], order[1::2])
    barrier = threading.Barrier(2)

    def fire(params: list[nn.Parameter]) -> None:
        barrier.wait()
        for p in params:
            reducer._on_grad(p)
            time.sleep(5e-5)  # backward computes the next gradient

    log.calls.clear()
    real_queue = grad_reducer.queue_backward_callback
    grad_reducer.queue_backward_callback = callbacks.append
    try:
        threads = [threading.Thread(target=fire, args=(half,)) for half in halves]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        grad_reducer.queue_backward_callback = real_queue
    launches = [sum(c is b.buffer for c in log.calls) for b in reducer.buckets]
    for callback in callbacks[:1]:  # one is run (the engine would run each; more is the bug)
        callback()
    return launches, len(callbacks)


def _threaded_reducer(rank: int, mean: bool) -> tuple[GradReducer, dict[int, torch.Tensor]]:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(64)) for _ in range(8)]
    g = torch.Generator().manual_seed(rank)
    grads = {id(p): torch.randn(64, generator=g) for p in params}
    # 512 B a bucket: two parameters each, one fired by each thread
    return GradReducer(params, mean=mean, cap_bytes=512, group=None), grads


def _threaded_runs(rank: int, world: int, repeats: int) -> dict:
    """Launch counts, callback counts and the largest difference from the plain all_reduce of
    each gradient, over ``repeats`` threaded steps."""
    reducer, grads = _threaded_reducer(rank, mean=True)
    expected = {}
    for p in reducer.params:
        expected[id(p)] = grads[id(p)] / world
        dist.all_reduce(expected[id(p)])
    log = _AllReduceLog(delay=1e-4)
    launches, finishes, diff = set(), set(), 0.0
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: races show up
    dist.all_reduce = log
    try:
        for _ in range(repeats):
            per_bucket, callbacks = _threaded_step(reducer, grads, log)
            launches.add(tuple(per_bucket))
            finishes.add(callbacks)
            diff = max(diff, max((p.grad - expected[id(p)]).abs().max().item()
                                 for p in reducer.params))
    finally:
        dist.all_reduce = log._real
        sys.setswitchinterval(switch)
        reducer.remove()
    return {"launches": launches, "buckets": len(reducer.buckets), "callbacks": finishes,
            "diff": diff}


def test_hooks_from_two_threads_launch_each_bucket_once_and_finish_once():
    parallel.init()
    result = _threaded_runs(0, 1, repeats=100)
    assert result["buckets"] == 4
    assert result["launches"] == {(1, 1, 1, 1)}
    assert result["callbacks"] == {1}
    assert result["diff"] == 0.0


# ------------------------------------------------------------------ 10. no bookkeeping traffic


class _BucketHostTraffic:
    """Counts, while entered, the calls that would move data between the host and a bucket
    buffer on an accelerator: reads back (``.cpu()``, ``.item()``, ``.tolist()``, ``.numpy()``,
    ``.to`` the host) and host values written in (``t[i] = x``, ``.fill_(x)``). Patches those
    methods on ``torch.Tensor`` (autograd runs hooks outside any torch function mode)."""

    READS = ("cpu", "item", "tolist", "numpy")
    WRITES = ("__setitem__", "fill_")

    def __init__(self, buckets) -> None:
        self.storages = {b.buffer.untyped_storage().data_ptr() for b in buckets}
        self.count = 0
        self._saved: dict[str, object] = {}

    def _in_bucket(self, tensor: torch.Tensor) -> bool:
        return not tensor.is_sparse and tensor.untyped_storage().data_ptr() in self.storages

    def _counting(self, name: str, real):
        def method(tensor, *args, **kwargs):
            to_host = name != "to" or any(str(a).startswith("cpu") for a in
                                          [*args, kwargs.get("device")]
                                          if isinstance(a, (str, torch.device)))
            if to_host and self._in_bucket(tensor):
                self.count += 1
            return real(tensor, *args, **kwargs)
        return method

    def __enter__(self) -> _BucketHostTraffic:
        for name in (*self.READS, *self.WRITES, "to"):
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._counting(name, self._saved[name]))
        return self

    def __exit__(self, *exc) -> None:
        for name, real in self._saved.items():
            setattr(torch.Tensor, name, real)


def test_no_host_device_traffic_for_bookkeeping():
    parallel.init()
    torch.manual_seed(0)
    reference = Net()
    model = parallel.data.DataParallel(copy.deepcopy(reference),
                                                bucket_cap_mb=0.0001)  # ~100 B
    assert len(model._reducer.buckets) > 2
    x, y = _batch(0)
    for _ in range(2):  # the second step accumulates into the gradients' bucket views
        F.mse_loss(reference(x), y).backward()
        traffic = _BucketHostTraffic(model._reducer.buckets)
        with traffic:
            F.mse_loss(model(x), y).backward()
        assert traffic.count == 0
        for p, r in zip(model.parameters(), reference.parameters(), strict=True):
            if r.grad is None:
                assert p.grad is None  # unused everywhere: left alone
            else:
                torch.testing.assert_close(p.grad, r.grad, rtol=0, atol=0)


# ------------------------------------------------------------------ 11. buckets follow a recast


def _recast_to_bf16(model: nn.Module) -> None:
    """Cast the model's parameters to bf16 the way OffloadAdamW(param_dtype=bf16) does."""
    OffloadAdamW(model.parameters(), lr=0.1, param_dtype=torch.bfloat16, kernel="torch",
                 overlap_backward=False)


def _bf16_step(rank: int) -> tuple[parallel.data.DataParallel, list[torch.Tensor]]:
    """One backward of an fp32-wrapped model recast to bf16; the dtypes of the floating tensors
    that went to ``dist.all_reduce``."""
    torch.manual_seed(0)
    model = parallel.data.DataParallel(Net(), bucket_cap_mb=0.001)
    _recast_to_bf16(model)
    log = _AllReduceLog()
    dist.all_reduce = log
    try:
        x, y = _batch(rank, torch.bfloat16)
        F.mse_loss(model(x), y).backward()
    finally:
        dist.all_reduce = log._real
    return model, [t.dtype for t in log.calls if t.is_floating_point()]


def test_buckets_follow_a_recast_to_bf16():
    parallel.init()
    model, sent = _bf16_step(0)
    torch.manual_seed(0)
    reference = Net().to(torch.bfloat16)
    x, y = _batch(0, torch.bfloat16)
    F.mse_loss(reference(x), y).backward()
    assert {b.buffer.dtype for b in model._reducer.buckets} == {torch.bfloat16}
    assert sent and set(sent) == {torch.bfloat16}
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.dtype == torch.bfloat16
        if r.grad is None:
            assert p.grad is None
        else:
            assert torch.equal(p.grad, r.grad)


def test_buckets_follow_parameters_moved_after_the_reducer_was_made():
    """Parameter offload rests a pipeline stage's weights on the host after the stage's
    DataParallel was made, and lands their gradients there: the reduction after the schedule
    re-buckets where the weights are now (the meta device stands in for the accelerator they
    were made on) and leaves host gradients on the host weights."""
    parallel.init()
    net = Net().to("meta")
    reducer = GradReducer(net.parameters(), mean=True, cap_bytes=2**20, group=dist.group.WORLD)
    assert {b.device.type for b in reducer.buckets} == {"meta"}
    gen = torch.Generator().manual_seed(0)
    grads = {}
    with torch.no_grad():
        for name, p in net.named_parameters():
            # moved home, the same parameter objects (ParamOffload's ``param.data = host``;
            # meta tensors take no ``.data`` of another device, so the contents are swapped)
            torch.utils.swap_tensors(p, nn.Parameter(torch.randn(p.shape, generator=gen)))
            if not name.startswith("never"):
                p.grad = torch.randn(p.shape, generator=gen)
                grads[name] = p.grad.clone()
    reducer.enabled = False  # backward ran under no_sync
    reducer.reduce_accumulated()
    assert {b.device.type for b in reducer.buckets} == {"cpu"}
    for name, p in net.named_parameters():
        if name in grads:
            assert p.grad.device.type == "cpu"
            torch.testing.assert_close(p.grad, grads[name])  # the mean over one rank
        else:
            assert p.grad is None


def _bf16_vs_ddp(rank: int, world: int) -> dict:
    model, sent = _bf16_step(rank)
    torch.manual_seed(0)
    ddp = DistributedDataParallel(Net().to(torch.bfloat16), find_unused_parameters=True)
    x, y = _batch(rank, torch.bfloat16)
    F.mse_loss(ddp(x), y).backward()
    equal = all((p.grad is None and r.grad is None) or torch.equal(p.grad, r.grad)
                for p, r in zip(model.parameters(), ddp.module.parameters(), strict=True))
    return {"sent": set(sent), "equal": equal}


# ------------------------------------------------------------------ one spawn of two ranks


# ------------------------------------------------------------------ keep mode (level2's scratch)


def _keep_steps(rank: int, world: int) -> dict:
    """Two steps of ``Net`` through a keep-mode reducer whose buckets hold two parameters or four
    (so its two scratch buffers are taken over within a step), against the plain reducer."""
    torch.manual_seed(0)
    plain_net = Net()
    keep_net = copy.deepcopy(plain_net)
    plain = GradReducer(plain_net.parameters(), mean=True, cap_bytes=100, group=None)
    kept: list[dict[int, torch.Tensor]] = []
    keep = GradReducer(keep_net.parameters(), mean=True, cap_bytes=100, group=None,
                       keep=lambda p, reduced: reduced.clone())
    keep.on_reduced = lambda: kept.append(dict(keep.kept))
    names = {id(p): n for n, p in keep_net.named_parameters()}
    out = {"buckets": len(keep.buckets), "scratch": [], "plain": [], "kept": [], "grads": []}
    for step in range(2):
        x, y = _batch(rank + 2 * step)
        for net in (plain_net, keep_net):
            F.mse_loss(net(x), y).backward()
        out["plain"].append({n: p.grad.clone() for n, p in plain_net.named_parameters()
                             if p.grad is not None})
        out["kept"].append({names[i]: t for i, t in kept[-1].items()})
        out["grads"].append([n for n, p in keep_net.named_parameters() if p.grad is not None])
        out["scratch"].append(sorted(t.data_ptr() for t in keep._scratch.values()))
        plain_net.zero_grad(set_to_none=True)
    plain.remove()
    keep.remove()
    return out


def _two_rank_suite(rank: int, world: int) -> dict:
    parallel.init()
    return {"sparse": _sparse_suite(rank, world), "threads": _threaded_runs(rank, world, 40),
            "bf16": _bf16_vs_ddp(rank, world), "keep": _keep_steps(rank, world)}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_two_rank_suite, 2, timeout=90)


@pytest.mark.slow
@pytest.mark.parametrize("mean", [True, False])
@pytest.mark.parametrize("used_by", [(0, 1), (0,)], ids=["both", "rank0"])
def test_sparse_by_all_gather_equals_gloo_sparse_all_reduce(two_ranks, mean, used_by):
    for result in two_ranks:
        gathered, native, sparse_calls, native_calls = result["sparse"][(mean, used_by)]
        assert sparse_calls == 0  # no sparse tensor reached all_reduce
        assert native_calls == 1
        assert gathered is not None
        assert torch.equal(gathered, native)
    torch.testing.assert_close(two_ranks[0]["sparse"][(mean, used_by)][0],
                               two_ranks[1]["sparse"][(mean, used_by)][0], rtol=0, atol=0)


@pytest.mark.slow
def test_usage_flags_riding_in_the_last_bucket_find_a_sparse_gradient_on_one_rank(two_ranks):
    got = [r["sparse"]["undeclared"] for r in two_ranks]
    assert all(g["flags in a bucket"] for g in got)
    torch.manual_seed(0)
    table, dense = nn.Embedding(30, 3, sparse=True), nn.Linear(3, 1)
    ids = torch.randint(0, 30, (5,), generator=torch.Generator().manual_seed(7))
    xs = [torch.randn(2, 3, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    (sum(dense(x).sum() for x in xs) / 2 + table(ids).pow(2).sum() / 2).backward()
    for g in got:  # sparse on rank 0 only: reduced as sparse on both, the mean of the ranks'
        torch.testing.assert_close(g["table"], table.weight.grad.to_dense())
        torch.testing.assert_close(g["dense"], dense.weight.grad)


def test_sparse_by_all_gather_equals_ddp_and_gloo_keeps_its_sparse_all_reduce(two_ranks):
    for result in two_ranks:
        assert torch.equal(result["sparse"][(True, (0, 1))][0], result["sparse"]["ddp"])
        assert result["sparse"]["auto_on_gloo"] == 1  # gloo has one: used


@pytest.mark.slow
def test_threaded_hooks_on_two_ranks_equal_the_plain_all_reduce(two_ranks):
    for result in (r["threads"] for r in two_ranks):
        assert result["launches"] == {(1,) * result["buckets"]}
        assert result["callbacks"] == {1}
        assert result["diff"] == 0.0


@pytest.mark.slow
def test_recast_gradients_travel_in_bf16_and_equal_ddp(two_ranks):
    for result in two_ranks:
        assert result["bf16"]["sent"] == {torch.bfloat16}
        assert result["bf16"]["equal"]


@pytest.mark.slow
def test_keep_mode_reuses_two_scratch_buffers_and_keeps_the_plain_reduction(two_ranks):
    """Level2's reducer: what it keeps is bit-equal to the plain reducer's gradients (unused
    parameters kept nowhere), no parameter keeps a whole gradient, and the same two scratch
    buffers serve every bucket of both steps."""
    for result in (r["keep"] for r in two_ranks):
        assert result["buckets"] > 2  # the scratch buffers are taken over within a step
        assert len(result["scratch"][0]) == 2 and result["scratch"][0] == result["scratch"][1]
        assert result["grads"] == [[], []]
        for plain, kept in zip(result["plain"], result["kept"], strict=True):
            assert "never.weight" not in kept and sorted(kept) == sorted(plain)
            for name, grad in plain.items():
                assert torch.equal(kept[name].view(grad.shape), grad), name
