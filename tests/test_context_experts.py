"""Context parallel with MoE layers (context × expert, context × data with an MoE model, each
also with optimizer parallel and as pipeline stages): routing is agreed over every rank holding
tokens (data × expert × context), so the balancing loss and each expert's load are the whole
batch's, the experts' rows travel over ``ep`` as without the split, and the mean loss and every
gradient equal one process's (rel 1e-5).

The MoE layers are dropless here: with a capacity, the choices that exceed it are dropped in
rank order (each context rank's tokens are its chunks of the sequences), where one process
drops them in sequence order."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor

import parallel
from context_helpers import assert_like_one_process, world_mean
from distributed import run_ranks
from parallel import ParallelConfig
from parallel.nn import MoE
from recipes.gpt import GPT

T = 16
MOE = {"num_experts": 4, "top_k": 2, "dropless": True, "aux_loss_factor": 0.05}


def _moe_gpt() -> GPT:
    """The seeded 2-block GPT whose every MLP is an MoE layer (the same on every rank)."""
    torch.manual_seed(0)
    return GPT(vocab_size=50, d_model=32, n_layer=2, n_head=4, block_size=T, dropout=0.0,
               moe=MOE, moe_every=1)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Four sequences of ids and their targets, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    idx, targets = (torch.randint(0, 50, (4, T), generator=gen) for _ in range(2))
    return idx, targets


def _experts_context(rank: int, world: int, expert: int, method: str) -> dict:
    parallel.init()
    reference = _moe_gpt()
    model = copy.deepcopy(reference)
    result = parallel.parallelize(model, ParallelConfig(context_degree=2, expert_degree=expert,
                                                        context_method=method))
    idx, targets = _batch(1)
    _, want = reference(idx, targets)
    want.backward()
    share, mine = 4 // result.config.batch_ranks, result.dims["batch"].get_local_rank()
    _, loss = result.model(idx[mine * share:(mine + 1) * share],
                           targets[mine * share:(mine + 1) * share])
    loss.backward()
    assert_like_one_process(model, reference, loss, want)
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    want_moe = next(m for m in reference.modules() if isinstance(m, MoE))
    return {"mesh": result.explain().split(";")[0], "load": moe.load.tolist(),
            "want_load": want_moe.load.tolist(), "local_experts": moe.experts.w1.to_local().shape[0]
            if isinstance(moe.experts.w1, DTensor) else moe.experts.w1.shape[0]}


@pytest.mark.slow
@pytest.mark.parametrize("world, expert, method", [
    (2, 1, "ring"),  # cp2: an MoE model's routing agreed over the context ranks
    (4, 2, "ring"),  # ep2 × cp2: the experts sharded, rows exchanged over ep
    (4, 1, "ulysses"),  # dp2 × cp2
])
def test_moe_layers_under_a_split_sequence_train_like_one_process(world: int, expert: int,
                                                                  method: str) -> None:
    first = run_ranks(_experts_context, world, expert, method, timeout=300)[0]
    assert first["mesh"] == (f"mesh pp=1 × dp={world // (2 * expert)} × ep={expert} × cp=2 × "
                             f"tp=1 (operators: replicas)")
    assert first["load"] == first["want_load"]  # the whole batch's choices per expert
    assert first["local_experts"] == 4 // expert


MICRO, STEPS = 2, 2


def _micro_batches(idx: torch.Tensor, targets: torch.Tensor, ranks: int) -> list:
    """Micro-batch m as ``ranks`` batch ranks feed it together: each one's rows cut in MICRO."""
    def micro(t: torch.Tensor, m: int) -> torch.Tensor:
        return torch.cat([part.chunk(MICRO)[m] for part in t.chunk(ranks)])
    return [(micro(idx, m), micro(targets, m)) for m in range(MICRO)]


def _stage_loss(output, target: torch.Tensor) -> torch.Tensor:
    from recipes.gpt import lm_loss

    return lm_loss(output[0] if isinstance(output, tuple) else output, target)


def _pipelined_moe(rank: int, world: int, expert: int, level: str | None) -> list[float]:
    """pp2 × (ep) × cp2, an MoE layer in each stage: AdamW steps, each rank's stage on its
    tokens (its batch rows under expert parallel); ``level``: optimizer parallel too."""
    parallel.init()
    model = _moe_gpt()
    sharded = {} if level is None else dict(enable_parallel_optimizer=True, optimizer_level=level,
                                            parallel_optimizer_threshold=0)
    config = ParallelConfig(pipeline_degree=2, context_degree=2, expert_degree=expert,
                            micro_batches=MICRO, **sharded)
    pipe = parallel.parallelize(model, config, loss_fn=_stage_loss).model
    rows = 4 // expert  # the batch is split over the expert ranks
    mine = parallel.ParallelDims(config.resolve(world))["batch"].get_local_rank()
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        idx, targets = _batch(step)
        opt.zero_grad()
        losses.append(pipe.step(idx[mine * rows:(mine + 1) * rows],
                                target=targets[mine * rows:(mine + 1) * rows]).item())
        opt.step()
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("world, expert, level", [(4, 1, None), (8, 2, None), (8, 2, "level1")])
def test_moe_stages_under_a_split_sequence_train_like_one_process(world, expert, level) -> None:
    """Each stage's MoE layers agree routing over the context ranks, so the step's loss (the
    language model's and the balancing losses, per micro-batch) is one process's; also with the
    optimizer sharded over the stage's replicas (the experts' over their dp × cp)."""
    reference = _moe_gpt()
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    want = []
    for step in range(STEPS):
        idx, targets = _batch(step)
        opt.zero_grad()
        total = 0.0
        for x, y in _micro_batches(idx, targets, expert):
            _, loss = reference(x, y)
            (loss / MICRO).backward()
            total += loss.item() / MICRO
        opt.step()
        want.append(total)
    for losses in run_ranks(_pipelined_moe, world, expert, level, timeout=400):
        assert losses == pytest.approx(want, rel=1e-5)


SHARDED = [(2, "level1"), (2, "level2"), (2, "level3"), (1, "level2")]  # (expert, level)


def _sharded_steps(rank: int, world: int) -> dict:
    """ep2 × cp2 (and dp2 × cp2 with the MoE experts whole) under optimizer parallel: the
    experts' shards sharded again over their dp × cp replicas, the rest over all four ranks.
    AdamW steps against one process: the first step's gradients, every step's mean loss."""
    parallel.init()
    out = {}
    for expert, level in SHARDED:
        reference = _moe_gpt()
        model = copy.deepcopy(reference)
        result = parallel.parallelize(model, ParallelConfig(
            context_degree=2, expert_degree=expert, enable_parallel_optimizer=True,
            optimizer_level=level, parallel_optimizer_threshold=0))
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
        share, mine = 4 // result.config.batch_ranks, result.dims["batch"].get_local_rank()
        for step in range(STEPS):
            idx, targets = _batch(step)
            _, want = reference(idx, targets)
            want.backward()
            _, loss = result.model(idx[mine * share:(mine + 1) * share],
                                   targets[mine * share:(mine + 1) * share])
            loss.backward()
            if step == 0:  # later, Adam's first update (about ±lr wherever a gradient is
                assert_like_one_process(model, reference, loss, want)  # near 0) dominates
                # the norm over both kinds of shard (experts' 2-D, the rest's), nothing clipped
                assert float(result.model.clip_grad_norm_(1e9)) == pytest.approx(
                    float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9)), rel=1e-5)
            else:
                assert world_mean(loss).item() == pytest.approx(want.item(), rel=1e-5)
            for opt in opts:
                opt.step()
                opt.zero_grad()
        out[(expert, level)] = result.explain()
    return out


@pytest.mark.slow
def test_moe_layers_under_a_split_sequence_and_optimizer_parallel_train_like_one_process():
    """Context × expert × optimizer (levels 1-3), and an MoE model under context × data ×
    optimizer: the same gradients and losses as one process (asserted on every rank)."""
    explained = run_ranks(_sharded_steps, 4, timeout=400)[0]
    assert ("MoE experts: ep=2 shards, each over its 2 replicas (dp × cp)"
            in explained[(2, "level2")])
