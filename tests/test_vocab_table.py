"""A tied embedding/head table under optimizer parallel level3 is sharded by vocabulary rows
(``parallel/optimizer_parallel/vocab_table.py``): training equals one process, the table is never
held whole outside the head, checkpoints and deferred init see one ``Shard(0)`` table, and small
or untied tables are left to FSDP2 as before."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from parallel.optimizer_parallel.vocab_table import tied_tables
from recipes.gpt import GPT
from tests.distributed import run_ranks

VOCAB, D_MODEL, SEQ = 515, 64, 16  # a vocabulary that does not divide by 2 or 4 ranks
STEPS = 3


def _model(meta: bool = False) -> GPT:
    """The GPT, whole (``parallel.materialize`` of the meta model: the values deferred init gives
    each rank's slices of) or on the meta device."""
    import parallel

    with torch.device("meta"):
        model = GPT(VOCAB, D_MODEL, 2, 2, SEQ)
    return model if meta else parallel.materialize(model, seed=0, device="cpu")


def _batches(world: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (2 * world, SEQ), generator=gen) for _ in range(STEPS)]


def _train(model: nn.Module, batches: list[torch.Tensor], rank: int, world: int,
           clip: bool = False) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for batch in batches:
        mine = batch.chunk(world)[rank]
        _, loss = model(mine, torch.roll(mine, -1, dims=1))
        loss.backward()
        if clip:
            model.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _reference(world: int, clip: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process over the global batch (each step's loss the mean of the ranks' losses)."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for batch in _batches(world):
        per_rank = [model(part, torch.roll(part, -1, dims=1))[1] for part in batch.chunk(world)]
        loss = sum(per_rank) / world
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append([x.item() for x in per_rank])
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _level3(rank: int, world: int, deferred: bool, clip: bool, directory: str) -> dict:
    import torch.distributed.checkpoint as dcp

    import parallel
    from parallel import ParallelConfig
    from parallel.optimizer_parallel.vocab_table import VocabShardedEmbedding, VocabShardedHead

    parallel.init()
    model = _model(meta=deferred)
    config = ParallelConfig(enable_parallel_optimizer=True, optimizer_level="level3")
    wrapped = parallel.parallelize(model, config, **({"init_seed": 0} if deferred else {})).model
    inner = wrapped.module
    kinds = (type(inner.tok_emb) is VocabShardedEmbedding, type(inner.lm_head) is VocabShardedHead,
             inner.tok_emb.weight is inner.lm_head.weight)
    local_rows = inner.tok_emb.weight.to_local().shape[0]
    first = {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
             for k, v in wrapped.state_dict().items()}
    losses = _train(wrapped, _batches(world), rank, world, clip)
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
             for k, v in wrapped.state_dict().items()}
    # a DCP checkpoint of the sharded table loads into a fresh model's blocks
    dcp.save(wrapped.state_dict(), checkpoint_id=directory)
    fresh = parallel.parallelize(_model(), config).model
    loaded = fresh.state_dict()
    dcp.load(loaded, checkpoint_id=directory)
    fresh.load_state_dict(loaded)
    reloaded = {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
                for k, v in fresh.state_dict().items()}
    parallel.destroy()
    return {"kinds": kinds, "local_rows": local_rows, "first": first, "losses": losses,
            "state": state, "reloaded": reloaded}


@pytest.mark.slow
@pytest.mark.parametrize(("world", "deferred"), [(2, True), (4, False)])
def test_level3_with_a_sharded_tied_table_trains_as_one_process(world: int, deferred: bool,
                                                              tmp_path):
    """Deferred init (2 ranks, with gradient clipping) and a whole model sharded (4 ranks); the
    trained model's DCP checkpoint reloads bitwise."""
    clip = world == 2
    ref_losses, ref_state = _reference(world, clip)
    init = {k: v.clone() for k, v in _model().state_dict().items()}
    results = run_ranks(_level3, world, deferred, clip, str(tmp_path / "ckpt"), timeout=240)
    rows = [r["local_rows"] for r in results]
    assert sum(rows) == VOCAB and max(rows) == -(-VOCAB // world)  # rows split, not copied
    for rank, result in enumerate(results):
        assert result["kinds"] == (True, True, True)
        for name, value in init.items():  # deferred init: bitwise the one-process values
            assert torch.equal(result["first"][name], value), name
        torch.testing.assert_close(result["losses"], [s[rank] for s in ref_losses],
                                   rtol=1e-5, atol=1e-6)
        for name, value in ref_state.items():  # atol: the key bias's gradient is zero up to
            # rounding (softmax ignores it), and Adam scales rounding noise up to lr
            torch.testing.assert_close(result["state"][name], value, rtol=1e-4, atol=1e-4,
                                       msg=lambda m, name=name: f"{name}: {m}")
            assert torch.equal(result["reloaded"][name], result["state"][name]), name


def test_only_tied_dense_tables_are_found():
    model = _model()
    assert tied_tables(model) == [(model.tok_emb, model.lm_head)]
    untied = _model()
    untied.lm_head.weight = nn.Parameter(untied.lm_head.weight.detach().clone())
    assert tied_tables(untied) == []
    sparse = nn.ModuleDict({"emb": nn.Embedding(8, 4, sparse=True), "head": nn.Linear(4, 8,
                                                                                     bias=False)})
    sparse.head.weight = sparse.emb.weight
    assert tied_tables(sparse) == []
