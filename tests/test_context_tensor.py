"""Context parallel under semi-auto strategies (context × tensor): each context rank runs the
model sharded over the strategies' ranks of its ``cp`` coordinate on its part of the sequence,
attention over the whole sequence through the shards' heads and batch rows; the mean loss and
every gradient equal one process's on the whole batch (rel 1e-5), with Megatron's tensor parallel,
its sequence-parallel preset and the dataset strategy; as pipeline stages (pipeline × context ×
tensor); and with the optimizer sharded over the strategies' data ranks (context × tensor ×
optimizer)."""

from __future__ import annotations

import copy

import pytest
import torch

import parallel
from context_helpers import assert_like_one_process
from distributed import run_ranks
from parallel import ParallelConfig
from parallel.semi_auto import load_strategy_file
from recipes.gpt import GPT

T = 16


def _gpt_and_its_copy() -> tuple[GPT, GPT]:
    """The one-process reference and the copy each test parallelizes (seed 0)."""
    torch.manual_seed(0)
    reference = GPT(vocab_size=50, d_model=32, n_layer=2, n_head=4, block_size=T, dropout=0.0)
    return reference, copy.deepcopy(reference)


def _tensor_context(rank: int, world: int, tensor: int, preset: str, method: str,
                    full_batch: bool) -> dict:
    parallel.init()
    reference, model = _gpt_and_its_copy()
    strategies = load_strategy_file(f"conf/strategy/{preset}.yaml", dp=world // (2 * tensor),
                                    mp=tensor)
    result = parallel.parallelize(model, ParallelConfig(
        context_degree=2, context_method=method, tensor_degree=tensor, strategies=strategies,
        full_batch=full_batch))
    gen = torch.Generator().manual_seed(1)
    idx, targets = (torch.randint(0, 50, (4, T), generator=gen) for _ in range(2))
    _, want = reference(idx, targets)
    want.backward()
    rows = slice(None)
    if not full_batch:  # the dataset strategy: each data rank feeds its own rows
        share = 4 // result.config.data_degree
        start = result.dims["dp"].get_local_rank() * share
        rows = slice(start, start + share)
    _, loss = result.model(idx[rows], targets[rows])
    loss.backward()
    assert_like_one_process(model, reference, loss, want)
    mlp = model.blocks[0].mlp[0].weight
    return {"mesh": result.explain().split(";")[0], "mlp_placements": str(mlp.placements)}


@pytest.mark.slow
@pytest.mark.parametrize("world, tensor, preset, method, full_batch", [
    (2, 1, "gpt_megatron", "ring", True),  # dp = tp = 1: the strategies' mesh is one rank
    (4, 1, "gpt_megatron", "ring", True),  # dp2 × cp2: batch rows split by the strategies
    (4, 2, "gpt_megatron", "ring", True),  # cp2 × tp2: Megatron's MLP split
    (4, 2, "gpt_megatron_sp", "ulysses", True),  # and its sequence-parallel preset
    # context × tensor × per_rank_batch: every input the model gets (the tokens and the
    # positions the split adds) is the data rank's rows
    (4, 1, "gpt_megatron", "ring", False),
])
def test_a_split_sequence_under_strategies_trains_like_one_process(
        world: int, tensor: int, preset: str, method: str, full_batch: bool) -> None:
    first = run_ranks(_tensor_context, world, tensor, preset, method, full_batch,
                      timeout=300)[0]
    assert first["mesh"] == (f"mesh pp=1 × dp={world // (2 * tensor)} × ep=1 × cp=2 × "
                             f"tp={tensor} (operators: strategies)")
    if tensor > 1:  # the column-parallel weight's rows split over the tensor ranks only
        assert first["mlp_placements"] == "(Shard(dim=0),)"


def _staged(rank: int, world: int) -> dict[str, tuple[list[float], dict]]:
    from pipeline_helpers import train_pipelined

    megatron = load_strategy_file("conf/strategy/gpt_megatron.yaml", dp=1, mp=2)
    data = load_strategy_file("conf/strategy/gpt_megatron.yaml", dp=2, mp=1)
    return {
        "tensor": train_pipelined(ParallelConfig(
            pipeline_degree=2, micro_batches=2, context_degree=2, tensor_degree=2,
            schedule="1f1b", strategies=megatron), 3)[:2],
        "optimizer": train_pipelined(ParallelConfig(
            pipeline_degree=2, micro_batches=2, context_degree=2, strategies=data,
            schedule="1f1b", enable_parallel_optimizer=True, optimizer_level="level2",
            parallel_optimizer_threshold=0), 3)[:2]}


@pytest.mark.slow
def test_pipeline_stages_under_strategies_run_on_a_split_sequence_like_one_process() -> None:
    """On 8 ranks, pp2 × cp2 × tp2: each stage sharded by Megatron's strategies over its tensor
    ranks, run on its context rank's share of the sequence, its gradients averaged over the
    context ranks; and pp2 × dp2 × cp2 with the optimizer sharded over the strategies' data
    ranks (level2). Every step's loss and every parameter after 3 AdamW steps as one process's
    (without the average over cp the second step's loss is already off by 0.6 %)."""
    from pipeline_helpers import reference

    want, want_params = reference(3)
    for runs in run_ranks(_staged, 8, timeout=600):
        for how, (losses, params) in runs.items():
            assert losses == pytest.approx(want, rel=1e-5), how
            assert params
            for name, value in params.items():
                torch.testing.assert_close(value, want_params[name], rtol=1e-5, atol=2e-5,
                                           msg=lambda m, name=name, how=how: f"{how} {name}: {m}")


def _sharded_optimizer(rank: int, world: int) -> dict[str, str]:
    """dp2 × cp2 under Megatron's strategies with optimizer parallel at each level: 3 AdamW
    steps on the whole batch, every step's mean loss and every parameter after them as one
    process's; the explanation of each level's sharding."""
    from context_helpers import world_mean

    parallel.init()
    strategies = load_strategy_file("conf/strategy/gpt_megatron.yaml", dp=2, mp=1)
    explained = {}
    for level in ("level1", "level2", "level3"):
        reference, model = _gpt_and_its_copy()
        result = parallel.parallelize(model, ParallelConfig(
            context_degree=2, strategies=strategies, enable_parallel_optimizer=True,
            optimizer_level=level, parallel_optimizer_threshold=0))
        ours = torch.optim.AdamW(result.model.parameters(), lr=1e-2)
        theirs = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            idx, targets = (torch.randint(0, 50, (4, T), generator=gen) for _ in range(2))
            losses = []
            for opt, net in ((ours, result.model), (theirs, reference)):
                opt.zero_grad()
                _, loss = net(idx, targets)
                loss.backward()
                opt.step()
                losses.append(loss)
            torch.testing.assert_close(world_mean(losses[0]), losses[1].detach(), rtol=1e-5,
                                       atol=1e-6)
        # atol 1e-4: a key bias has no true gradient (softmax ignores a shift shared by every
        # key), and AdamW turns the rounding noise it gets (~1e-9) into steps near eps's bound
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            torch.testing.assert_close(full, q, rtol=1e-5, atol=1e-4 if "qkv.bias" in name
                                       else 2e-5,
                                       msg=lambda m, name=name, level=level: f"{level} {name}: {m}")
        explained[level] = result.model.explain()
    return explained


@pytest.mark.slow
def test_optimizer_parallel_under_strategies_on_a_split_sequence_trains_like_one_process(
        ) -> None:
    """context × tensor × optimizer: the optimizer sharded over the strategies' data ranks,
    every gradient (sharded by FSDP2 or left whole under the size threshold) averaged over
    the context ranks, which hold the same shards; level1, level2 and level3 each train 3
    steps as one process does."""
    explained = run_ranks(_sharded_optimizer, 4, timeout=400)[0]
    for level, line in explained.items():
        assert line.startswith(f"optimizer parallel {level} over ")
        assert "optimizer state 1/2 per rank" in line, line
        assert line.endswith("every gradient then averaged over the 2 context ranks holding "
                             "the same shards"), line


def test_optimizer_parallel_under_strategies_needs_data_ranks_beside_the_context_ranks(
        ) -> None:
    config = ParallelConfig(context_degree=2, tensor_degree=2, strategies={"x": [[1]]},
                            enable_parallel_optimizer=True)
    with pytest.raises(ValueError, match="shards over the strategies' data ranks .* but "
                                         "data_degree=1"):
        config.resolve(4)
