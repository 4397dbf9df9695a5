"""DataParallel on 2 and 4 gloo ranks against single-process training and torch DDP."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import hetero
import parallel
from distributed import run_ranks
from recipes.gpt import GPT

LOCAL_BATCH = 4


class Net(nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, hidden), nn.Linear(hidden, 1)
        self.extra = nn.Linear(8, 1)      # used only when asked (unused-parameter tests)
        self.never = nn.Linear(8, 1)      # never used by forward
        self.register_buffer("scale", torch.ones(1) * 0.5)

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        out = self.fc2(torch.tanh(self.fc1(x))) * self.scale
        return out + self.extra(x) if use_extra else out


def _global_batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(LOCAL_BATCH * world, 8, generator=g), torch.randn(LOCAL_BATCH * world, 1,
                                                                           generator=g)


def _mine(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH]


def _train_vs_single(rank: int, world: int, mean: bool, micro: int, steps: int = 3) -> float:
    """Max relative parameter difference between DP training and one process on the whole
    batch, after ``steps`` SGD steps of ``micro`` accumulated micro-batches each."""
    torch.manual_seed(0)
    reference = Net()
    torch.manual_seed(rank)  # different on every rank: the broadcast must fix it
    model = parallel.data.DataParallel(Net(), gradients_mean=mean)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(steps):
        for m in range(micro):
            x, y = _global_batch(step * micro + m, world)
            loss = F.mse_loss(reference(x), y) * (1 if mean else world)
            loss.backward()
            local = F.mse_loss(model(_mine(x, rank)), _mine(y, rank))
            if m < micro - 1:
                with model.no_sync():
                    local.backward()
            else:
                local.backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    return max(((p - r).abs().max() / r.abs().max()).item()
               for p, r in zip(model.parameters(), reference.parameters(), strict=True)
               if r.abs().max() > 0)


def _grads_vs_ddp(rank: int, world: int) -> bool:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    ours, ddp = parallel.data.DataParallel(build()), DistributedDataParallel(build())
    x, y = _global_batch(0, world)
    for m in (ours, ddp):
        F.mse_loss(m(_mine(x, rank)), _mine(y, rank)).backward()
    return all(torch.equal(a.grad, b.grad)
               for a, b in zip(ours.parameters(), ddp.module.parameters(), strict=True))


def _unused_parameters(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = parallel.data.DataParallel(Net())
    x, y = _global_batch(0, world)
    use = rank == 0  # only rank 0 uses `extra`
    F.mse_loss(model(_mine(x, rank), use_extra=use), _mine(y, rank)).backward()
    return {"extra": model.extra.weight.grad.clone(), "never": model.never.weight.grad,
            "fc1": model.fc1.weight.grad.clone()}


def _sparse_embedding(rank: int, world: int) -> float:
    torch.manual_seed(0)
    table = nn.Embedding(50, 4, sparse=True)
    reference = copy.deepcopy(table)
    model = parallel.data.DataParallel(table)
    ids = torch.randint(0, 50, (world, 6), generator=torch.Generator().manual_seed(3))
    model(ids[rank]).pow(2).sum().backward()
    (reference(ids).pow(2).sum() / world).backward()
    assert model.weight.grad.is_sparse
    assert model.buckets == []  # a declared-sparse table takes no dense bucket slot
    return (model.weight.grad.to_dense() - reference.weight.grad.to_dense()).abs().max().item()


def _two_rank_suite(rank: int, world: int) -> dict:
    parallel.init()
    return {
        "mean": _train_vs_single(rank, world, mean=True, micro=1),
        "sum": _train_vs_single(rank, world, mean=False, micro=1),
        "accumulate": _train_vs_single(rank, world, mean=True, micro=3),
        "ddp_bit_equal": _grads_vs_ddp(rank, world),
        "unused": _unused_parameters(rank, world),
        "sparse": _sparse_embedding(rank, world),
    }


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_two_rank_suite, 2, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mean", "sum", "accumulate"])
def test_training_matches_one_process_on_the_whole_batch(two_ranks, case):
    for result in two_ranks:
        assert result[case] < 1e-5


@pytest.mark.slow
def test_gradients_bit_equal_to_torch_ddp(two_ranks):
    assert all(r["ddp_bit_equal"] for r in two_ranks)


@pytest.mark.slow
def test_unused_parameters_do_not_hang(two_ranks):
    zero, one = (r["unused"] for r in two_ranks)
    torch.testing.assert_close(zero["extra"], one["extra"])  # rank 1 gets rank 0's share
    assert zero["never"] is None and one["never"] is None  # unused everywhere: left alone
    torch.testing.assert_close(zero["fc1"], one["fc1"])


@pytest.mark.slow
def test_row_sparse_gradients_are_reduced_sparse(two_ranks):
    assert all(r["sparse"] < 1e-6 for r in two_ranks)


def _four_rank_suite(rank: int, world: int) -> dict:
    parallel.init()
    torch.manual_seed(rank)
    # ~100 B of the model's 716: several buckets
    wrapped = parallel.data.DataParallel(Net(), bucket_cap_mb=0.0001)
    gathered = [torch.empty(0)] * world
    flat = torch.cat([p.detach().reshape(-1) for p in wrapped.parameters()])
    gathered = parallel.collectives.all_gather(flat.unsqueeze(0)).unbind(0)
    return {"buckets": wrapped.buckets,
            "equal_after_broadcast": all(torch.equal(g, gathered[0]) for g in gathered),
            "accumulate": _train_vs_single(rank, world, mean=True, micro=2)}


@pytest.mark.slow
def test_four_ranks_broadcast_buckets_and_accumulation():
    results = run_ranks(_four_rank_suite, 4, timeout=240)
    for r in results:
        assert r["equal_after_broadcast"]
        assert r["accumulate"] < 1e-5
        assert len(r["buckets"]) > 1
        # Reverse registration order: the last layers' gradients fill the first bucket.
        order = [name for bucket in r["buckets"] for name in bucket]
        assert order == ["never.bias", "never.weight", "extra.bias", "extra.weight",
                         "fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight"]


def _wrap_errors(rank: int, world: int) -> dict:
    parallel.init()
    out = {}
    torch.manual_seed(rank)
    try:
        parallel.data.DataParallel(Net(), parameter_broadcast=False)
    except ValueError as err:
        out["unequal"] = str(err)
    torch.manual_seed(0)
    parallel.data.DataParallel(Net(), parameter_broadcast=False)  # equal: accepted
    try:
        parallel.data.DataParallel(Net(hidden=16 if rank == 0 else 12))
    except ValueError as err:
        out["mismatch"] = str(err)
    return out


@pytest.mark.slow
def test_wrap_time_errors_instead_of_hangs():
    results = run_ranks(_wrap_errors, 2, timeout=120)
    for r in results:
        assert "parameter_broadcast=False): 'fc1.weight' on rank 1 differs" in r["unequal"]
        assert "hold different models: tensor #0 is ('fc1.weight', (16, 8)" in r["mismatch"] \
            or "hold different models: tensor #0 is ('fc1.weight', (12, 8)" in r["mismatch"]


def _placed_gpt(rank: int, world: int) -> float:
    parallel.init()
    torch.manual_seed(0)
    model = GPT(40, 32, 1, 2, 16, 0.0)
    reference = copy.deepcopy(model)
    hetero.set_device(model.tok_emb, "cpu")
    wrapped = parallel.data.DataParallel(hetero.place(model))
    # SGD: Adam's normalisation would amplify float summation-order noise in near-zero grads.
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(4):
        idx = torch.randint(0, 40, (2 * world, 16), generator=torch.Generator().manual_seed(step))
        _, loss = wrapped(idx[2 * rank:2 * rank + 2], idx[2 * rank:2 * rank + 2].roll(1, 1))
        loss.backward()
        _, ref_loss = reference(idx, idx.roll(1, 1))
        ref_loss.backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    assert wrapped.tok_emb.weight.device == torch.device("cpu")
    return max((p - r).abs().max().item()
               for p, r in zip(wrapped.parameters(), reference.parameters(), strict=True))


@pytest.mark.slow
def test_host_placed_embedding_trains_data_parallel_like_one_process():
    assert all(diff < 1e-5 for diff in run_ranks(_placed_gpt, 2, timeout=180))


def test_wrap_needs_init_and_valid_arguments():
    with pytest.raises(RuntimeError, match=r"call parallel\.init\(\) first"):
        parallel.data.DataParallel(Net())
    parallel.init()
    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive number"):
        parallel.data.DataParallel(Net(), bucket_cap_mb=0)
    with pytest.raises(TypeError, match="wraps an nn.Module"):
        parallel.data.DataParallel(lambda x: x)
    wrapped = parallel.data.DataParallel(Net())
    assert list(wrapped.state_dict()) == list(Net().state_dict())  # no "module." prefix


def _parallelize_reads_the_context(rank: int, world: int) -> tuple[bool, bool]:
    parallel.init()
    parallel.context.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True,
                                               parameter_broadcast=True)
    torch.manual_seed(rank)
    wrapped = parallel.parallelize(Net(), parallel.ParallelConfig.from_context()).model
    flat = torch.cat([p.detach().reshape(-1) for p in wrapped.parameters()])
    gathered = parallel.collectives.all_gather(flat.unsqueeze(0))
    summed = parallel.parallelize(Net(), parallel.ParallelConfig.from_context(
        gradients_mean=False)).model
    return torch.equal(gathered[0], gathered[1]), summed.gradients_mean


@pytest.mark.slow
def test_parallelize_data_parallel_takes_settings_from_the_context():
    for broadcast_equal, mean in run_ranks(_parallelize_reads_the_context, 2):
        assert broadcast_equal and mean is False
