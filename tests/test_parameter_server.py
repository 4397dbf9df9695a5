"""Row-sharded host tables (``EmbeddingLookup(sharding="row")``): lookups and 20 LazyAdam / FTRL
steps on 2 and 4 gloo ranks equal one unsharded table trained on the concatenated batch, with
duplicate ids, ids all owned by one rank and an empty batch on one rank; each rank holds 1/N of
the table and of its optimizer state; bad ids fail on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import hetero
import parallel
from distributed import error_after_rank_1_dies, run_ranks

VOCAB, DIM, STEPS = 53, 6, 20


def _table() -> torch.Tensor:
    return torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(0))


def _ids(step: int, rank: int, world: int, case: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    if case == "one_owner":  # every id in rank 0's block
        return torch.randint(0, VOCAB // world, (5, 3), generator=g)
    if case == "empty" and rank == world - 1:
        return torch.empty(0, 3, dtype=torch.int64)
    ids = torch.randint(0, VOCAB, (5, 3), generator=g)
    ids[0] = ids[1]  # duplicates inside the batch; other ranks draw some of the same ids too
    return ids


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "lazy_adam":
        return hetero.optim.LazyAdam(params, lr=0.05)
    return hetero.optim.FTRL(params, lr=0.05, l1=1e-3, l2=1e-3)


def _target(ids: torch.Tensor) -> torch.Tensor:
    return torch.sin(ids.unsqueeze(-1).float() + torch.arange(DIM))


def _train(table: hetero.nn.EmbeddingLookup, optim: str, batches, mean: bool) -> list[float]:
    opt = _optimizer(optim, table.parameters())
    losses = []
    for ids in batches:
        opt.zero_grad()
        err = (table(ids) - _target(ids)) ** 2
        loss = err.mean() if mean else err.sum()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _sharded(rank: int, world: int, optim: str, case: str) -> dict:
    parallel.init()
    mean = case != "empty"  # an empty batch has no mean: sum losses, sum pushed gradients
    table = hetero.nn.EmbeddingLookup(VOCAB, DIM, param_init=_table(), sharding="row",
                                      gradients_mean=mean)
    first = table(_ids(0, rank, world, case)).detach().clone()
    losses = _train(table, optim, [_ids(s, rank, world, case) for s in range(STEPS)], mean)
    weight = table.weight.detach().clone()
    opt = _optimizer(optim, table.parameters())  # one more step to count this rank's state
    opt.zero_grad()
    table(_ids(0, rank, world, case)).sum().backward()
    opt.step()
    state = sum(t.numel() for s in opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor) and t.dim())
    return {"rows": table.row_range, "weight": weight, "first": first,
            "losses": losses, "state_elements": state}


def _reference(world: int, optim: str, case: str) -> dict:
    table = hetero.nn.EmbeddingLookup(VOCAB, DIM, param_init=_table())
    first = [table(_ids(0, r, world, case)).detach() for r in range(world)]
    batches = [torch.cat([_ids(s, r, world, case) for r in range(world)]) for s in range(STEPS)]
    mean = case != "empty"
    losses = _train(table, optim, batches, mean)
    return {"weight": table.weight.detach(), "first": first, "losses": losses}


@pytest.mark.slow
@pytest.mark.parametrize("world, optim, case", [
    (2, "lazy_adam", "mixed"), (2, "ftrl", "mixed"), (2, "lazy_adam", "one_owner"),
    (2, "ftrl", "empty"), (4, "lazy_adam", "mixed"), (4, "ftrl", "empty"),
])
def test_a_sharded_table_trains_like_one_table(world, optim, case):
    results = run_ranks(_sharded, world, optim, case, timeout=240)
    want = _reference(world, optim, case)
    whole = torch.cat([r["weight"] for r in results])
    torch.testing.assert_close(whole, want["weight"], rtol=1e-6, atol=1e-6)
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["first"], want["first"][rank], rtol=0, atol=0)
    if case != "empty":  # the mean of the ranks' means is the mean of the concatenated batch
        got = [sum(r["losses"][s] for r in results) / world for s in range(STEPS)]
        assert got == pytest.approx(want["losses"], rel=1e-6)
    # each rank holds one block of rows, and optimizer state for its block only
    assert [r["rows"] for r in results] == [
        (min(k * -(-VOCAB // world), VOCAB), min((k + 1) * -(-VOCAB // world), VOCAB))
        for k in range(world)]
    for r in results:
        rows = r["rows"][1] - r["rows"][0]
        assert r["weight"].shape == (rows, DIM)
        assert r["state_elements"] <= 2 * rows * DIM  # exp_avg + exp_avg_sq, or n + z


def _bad_id(rank: int, world: int) -> str:
    parallel.init()
    table = hetero.nn.EmbeddingLookup(VOCAB, DIM, sharding="row")
    ids = torch.tensor([1, 2, VOCAB + 7 if rank == 1 else 3])
    try:
        table(ids)
    except IndexError as err:
        return str(err)
    return "no error"


@pytest.mark.slow
def test_an_out_of_range_id_fails_on_every_rank_naming_the_vocabulary():
    first, second = run_ranks(_bad_id, 2, timeout=120)
    assert "index 60 is out of range for vocab_size 53" in second
    assert "rank(s) [1] looked up indices outside 0 .. 52 (vocab_size 53)" in first


def test_row_sharding_needs_sparse_gradients_and_a_process_group():
    with pytest.raises(ValueError, match="sharding 'column' is not one of"):
        hetero.nn.EmbeddingLookup(VOCAB, DIM, sharding="column")
    with pytest.raises(ValueError, match="sharding='row' needs sparse=True"):
        hetero.nn.EmbeddingLookup(VOCAB, DIM, target="DEVICE", sparse=False, sharding="row")
    if parallel.is_initialized():
        parallel.destroy()
    with pytest.raises(ValueError, match="there is none: call parallel.init\\(\\) first"):
        hetero.nn.EmbeddingLookup(VOCAB, DIM, sharding="row")


# ---------------------------------------------------------------- checkpoints
GLOBAL_IDS = 12  # per step, split evenly over 2 or 4 ranks


def _global_ids(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (GLOBAL_IDS,), generator=torch.Generator().manual_seed(step))


def _steps(table, opt, steps: range, rank: int, world: int) -> None:
    for step in steps:
        ids = _global_ids(step).chunk(world)[rank]
        opt.zero_grad()
        ((table(ids) - _target(ids)) ** 2).mean().backward()
        opt.step()


def _fresh(optim: str):
    table = hetero.nn.EmbeddingLookup(VOCAB, DIM, param_init=_table(), sharding="row")
    return table, _optimizer(optim, table.parameters())


def _save_then_continue(rank: int, world: int, optim: str, path: str) -> torch.Tensor:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    parallel.init()
    table, opt = _fresh(optim)
    _steps(table, opt, range(5), rank, world)
    model_sd, optim_sd = get_state_dict(table, opt,
                                        options=StateDictOptions(flatten_optimizer_state_dict=True))
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    _steps(table, opt, range(5, 10), rank, world)
    return table.weight.detach().clone()


def _resume(rank: int, world: int, optim: str, path: str) -> torch.Tensor:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )
    parallel.init()
    table, opt = _fresh(optim)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    model_sd, optim_sd = get_state_dict(table, opt, options=flat)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(table, opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=flat)
    _steps(table, opt, range(5, 10), rank, world)
    return table.weight.detach().clone()


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["lazy_adam", "ftrl"])
def test_dcp_saves_each_block_once_and_resumes_at_two_and_four_ranks(tmp_path, optim):
    path = str(tmp_path / "ckpt")
    straight = torch.cat(run_ranks(_save_then_continue, 2, optim, path, timeout=180))
    for world in (2, 4):  # the same global batches, re-sharded table and optimizer state
        resumed = torch.cat(run_ranks(_resume, world, optim, path, timeout=180))
        torch.testing.assert_close(resumed, straight, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- memory and failures
BIG_VOCAB, BIG_DIM = 40_000, 32  # 5.1 MB of table; Adam state doubles it


def _within_budget(rank: int, world: int, budget: int) -> int:
    parallel.init()
    table = hetero.nn.EmbeddingLookup(BIG_VOCAB, BIG_DIM, sharding="row")
    opt = hetero.optim.LazyAdam(table.parameters(), lr=0.01)
    for step in range(3):
        ids = torch.randint(0, BIG_VOCAB, (64,), generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        table(ids.chunk(world)[rank]).square().mean().backward()
        opt.step()
    held = table.weight.numel() * 4 + sum(
        t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim())
    assert held <= budget, f"rank {rank} holds {held} bytes, over its budget of {budget}"
    return held


@pytest.mark.slow
def test_a_table_no_rank_could_hold_trains_within_each_ranks_budget():
    whole = BIG_VOCAB * BIG_DIM * 4 * 3  # table + exp_avg + exp_avg_sq
    budget = int(whole / 4 * 1.1)  # 1/N of the whole, plus 10%
    held = run_ranks(_within_budget, 4, budget, timeout=180)
    assert sum(held) == whole  # every row held once, with its state, somewhere


def _peer_dies(rank: int, world: int) -> str | None:
    parallel.init()
    table = hetero.nn.EmbeddingLookup(VOCAB, DIM, sharding="row")
    return error_after_rank_1_dies(rank, lambda: table(torch.tensor([1, 40])))


@pytest.mark.slow
def test_a_dead_rank_surfaces_as_a_collective_error_naming_the_exchange():
    message, _ = run_ranks(_peer_dies, 2, may_die=(1,), timeout=120)
    assert message is not None and message.startswith(
        "EmbeddingLookup(sharding='row') id exchange failed on rank 0 of 2")


def test_placing_a_model_with_a_sharded_table_is_refused_by_name():
    parallel.init()
    model = torch.nn.Sequential(hetero.nn.EmbeddingLookup(VOCAB, DIM, sharding="row"),
                                torch.nn.Linear(DIM, 2))
    hetero.set_device(model[1], "cpu")
    with pytest.raises(hetero.placement.CaptureError,
                       match=r"EmbeddingLookup\(sharding='row'\) cannot be captured"):
        hetero.place(model, (torch.tensor([[1, 2]]),))


def _named_init(rank: int, world: int, init: str) -> torch.Tensor:
    parallel.init()
    torch.manual_seed(7)  # every rank alike, as the recipes do
    return hetero.nn.EmbeddingLookup(70_000, 4, param_init=init, sharding="row").weight.detach()


@pytest.mark.slow
@pytest.mark.parametrize("init", ["normal", "xavier_uniform"])
def test_a_named_init_gives_the_same_table_at_any_world_size(init):
    """70 000 rows cross a 65 536-row seeding piece, split differently at 2 and 4 ranks."""
    two, four = (torch.cat(run_ranks(_named_init, n, init, timeout=120)) for n in (2, 4))
    assert two.shape == (70_000, 4) and torch.equal(two, four)
    assert two.std() > 0 and len(set(two[:, 0].tolist())) > 69_000  # random, no repeats
