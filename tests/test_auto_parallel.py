"""Auto parallel (sharding propagation) applied on 2 and 4 gloo ranks: the reference's MatMul ->
BiasAdd -> ReLU -> MatMul with only the first MatMul annotated trains like one device, with the
one AllReduce the plan predicts; plans given with plan=; refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import parallel
from comm_counter import collectives
from distributed import run_ranks
from parallel import ParallelConfig


class PlannedMLP(nn.Module):
    """MindSpore's example written with shardable operators; only ``first`` is annotated. Sized
    so that moving activations costs more than a bias's gradient all-reduce (else the planner
    rightly keeps the batch whole)."""

    def __init__(self, first=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(64, 512) / 8)
        self.b = nn.Parameter(torch.randn(512))
        self.v = nn.Parameter(torch.randn(512, 64) / 16)
        self.matmul1 = parallel.shard(torch.matmul, first)
        self.add = parallel.shard(torch.add)
        self.relu = parallel.shard(torch.relu)
        self.matmul2 = parallel.shard(torch.matmul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul2(self.relu(self.add(self.matmul1(x, self.w), self.b)), self.v)


ANNOTATION = {2: ((1, 1), (1, 2)), 4: ((2, 1), (1, 2))}
EXPECTED = {2: {"add": ((1, 2), (2,)), "relu": ((1, 2),), "matmul2": ((1, 2), (2, 1))},
            4: {"add": ((2, 2), (2,)), "relu": ((2, 2),), "matmul2": ((2, 2), (2, 1))}}


def _train(rank: int, world: int) -> dict:
    parallel.init()
    reference = PlannedMLP()  # no strategies: the plain operators, on one device
    model = PlannedMLP(ANNOTATION[world])
    x = torch.randn(1024, 64, generator=torch.Generator().manual_seed(1))
    parallel.parallelize(model, ParallelConfig(search_mode="sharding_propagation"),
                         example_inputs=(x,))
    planned = {name: getattr(model, name).in_strategy for name in EXPECTED[world]}
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    forward = {}
    for step in range(3):
        for m, opt in zip((reference, model), opts, strict=True):
            opt.zero_grad()
            if m is model and step == 0:
                forward = collectives(lambda: model(x))
            m(x).square().mean().backward()
            opt.step()
    got = {n: p.full_tensor() for n, p in model.named_parameters()}
    for name, p in reference.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-6)
    return {"planned": planned, "forward": forward}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_propagated_reference_mlp_trains_like_one_device(world):
    for result in run_ranks(_train, world):
        assert result["planned"] == EXPECTED[world]
        # the partial sums of MatMul2 reduced once (and on 4 ranks the batch halves gathered)
        assert len(result["forward"].get("all_reduce", [])) == 1


def _saved_plan(rank: int, world: int, path: str) -> bool:
    parallel.init()
    x = torch.randn(1024, 64, generator=torch.Generator().manual_seed(1))  # alike on every rank
    planner = PlannedMLP(ANNOTATION[world])
    plan = parallel.plan_auto_parallel(planner, (x,), device_num=world)
    plan.save(path)
    model = PlannedMLP(ANNOTATION[world])
    parallel.parallelize(model, ParallelConfig(search_mode="sharding_propagation"), plan=path)
    torch.testing.assert_close(model(x), PlannedMLP()(x), rtol=1e-5, atol=1e-6)
    return model.matmul2.in_strategy == EXPECTED[world]["matmul2"]


@pytest.mark.slow
def test_a_saved_plan_applies_without_planning(tmp_path):
    assert run_ranks(_saved_plan, 2, str(tmp_path / "plan.yaml")) == [True, True]


def test_auto_parallel_refusals_name_the_rule():
    parallel.init()
    try:
        with pytest.raises(ValueError, match="pass example_inputs"):
            parallel.parallelize(PlannedMLP(((1, 1), (1, 1))),
                                 ParallelConfig(search_mode="sharding_propagation"))
        with pytest.raises(ValueError, match="search_mode 'greedy' is not one of"):
            parallel.parallelize(PlannedMLP(), ParallelConfig(search_mode="greedy"),
                                 example_inputs=(torch.randn(2, 64),))
        with pytest.raises(ValueError, match="needs an in_strategy"):
            parallel.shard(nn.Linear(2, 2))
        # the MindSpore front door: the context's mode and search mode
        parallel.context.set_auto_parallel_context(parallel_mode="auto_parallel",
                                                   search_mode="sharding_propagation")
        result = parallel.parallelize(PlannedMLP(((1, 1), (1, 1))), ParallelConfig.from_context(),
                                      example_inputs=(torch.randn(4, 64),))
        assert result.plan.by_op["matmul"] == ((1, 1), (1, 1))
        parallel.context.set_auto_parallel_context(search_mode="recursive_programming")
        result = parallel.parallelize(PlannedMLP(), ParallelConfig.from_context(),
                                      example_inputs=(torch.randn(4, 64),))
        assert result.plan.search_mode == "recursive_programming"
    finally:
        parallel.context.reset_auto_parallel_context()
        parallel.destroy()


def _gpt_comms(rank: int, world: int) -> dict:
    from parallel.semi_auto import load_strategy_file
    from recipes.gpt import GPT
    from recipes.parallel_mode import STRATEGY_DIR
    parallel.init()
    # the recipe's sizes: large enough that bytes, not latency, decide between an all-reduce of
    # the block output and gathers of the 4x wider MLP activations
    idx = torch.randint(0, 65, (16, 64), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 65, (16, 64), generator=torch.Generator().manual_seed(1))
    found = {}
    for name in ("gpt_megatron", "gpt_mlp_columns"):
        torch.manual_seed(0)
        model = GPT(65, 192, 2, 6, 64)
        strategies = load_strategy_file(STRATEGY_DIR / f"{name}.yaml", dp=1, mp=world)
        planned = parallel.plan_auto_parallel(model, (idx,), device_num=world,
                                              strategies=strategies)
        if name == "gpt_megatron":
            parallel.parallelize(model, ParallelConfig(strategies=strategies))
        else:
            parallel.parallelize(model, ParallelConfig(search_mode="sharding_propagation",
                                                       strategies=strategies),
                                 example_inputs=(idx,))
        calls = collectives(lambda m=model: m(idx, targets)[1].backward())
        found[name] = {"calls": calls, "modelled": sum(c.bytes for op in planned.ops
                                                       for c in op.comms),
                       "row": [planned.strategies[f"blocks.{i}.mlp.2"] for i in range(2)]}
    return found


@pytest.mark.slow
def test_annotated_gpt_gets_megatron_rows_with_no_more_communication_than_hand_written():
    found = run_ranks(_gpt_comms, 2)[0]
    auto, hand = found["gpt_mlp_columns"], found["gpt_megatron"]
    assert auto["row"] == [((1, 1, 2), (1, 2))] * 2  # Megatron's row-parallel outputs
    assert auto["modelled"] <= hand["modelled"]
    count = {name: sum(len(v) for v in f["calls"].values()) for name, f in found.items()}
    volume = {name: sum(sum(v) for v in f["calls"].values()) for name, f in found.items()}
    assert count["gpt_mlp_columns"] <= count["gpt_megatron"], found
    assert volume["gpt_mlp_columns"] <= volume["gpt_megatron"], found


def _plans_from_different_profiles(rank: int, world: int, root: str) -> dict:
    import dataclasses
    import os
    from pathlib import Path

    from parallel.auto.cost_model import default_profile
    from parallel.auto.profile import saved_profile
    parallel.init()
    os.environ["HETERO_PARALLEL_CACHE"] = str(Path(root) / f"host{rank}")  # one cache per host
    measured = parallel.auto.profile_devices(repeats=2)  # the job agrees on one profile ...
    assert saved_profile() == measured
    # ... but a host may hold another: rank 1's links are a thousand times slower
    slow = dataclasses.replace(default_profile(), bandwidth=1e6 if rank == 1 else 1e12)
    slow.save(Path(root) / f"host{rank}" / f"device-profile-{slow.kind}.yaml")
    x = torch.randn(1024, 64, generator=torch.Generator().manual_seed(1))
    alone = parallel.plan_auto_parallel(PlannedMLP(), (x,), device_num=world,
                                        search_mode="dynamic_programming").strategies
    model = PlannedMLP()
    result = parallel.parallelize(model, ParallelConfig(search_mode="dynamic_programming"),
                                  example_inputs=(x,))
    torch.testing.assert_close(model(x), PlannedMLP()(x), rtol=1e-5, atol=1e-6)
    return {"profile": dataclasses.asdict(measured), "alone": alone,
            "applied": result.plan.strategies}


@pytest.mark.slow
def test_ranks_apply_one_plan_even_from_different_saved_profiles(tmp_path):
    first, second = run_ranks(_plans_from_different_profiles, 2, str(tmp_path))
    assert first["profile"] == second["profile"]  # profile_devices averages the ranks' figures
    assert first["alone"] != second["alone"]  # left alone, the ranks would plan differently
    assert first["applied"] == second["applied"] == first["alone"]  # rank 0's plan, applied


@pytest.mark.parametrize(("dp", "mp"), [(2, 1), (2, 2), (4, 1)])
def test_the_two_line_annotation_plans_with_data_ranks(dp, mp):
    """``gpt_mlp_columns`` with data ranks: an annotation that allows a neighbour neither to
    follow nor to stay whole was priced over nothing (``min() arg is an empty sequence``); the
    lookahead now prices such a neighbour at every layout it has, and the plan is Megatron's
    MLP over the data ranks."""
    from parallel.auto.plan import plan_auto_parallel
    from parallel.semi_auto import load_strategy_file
    from recipes.gpt import GPT

    with torch.device("meta"):
        model = GPT(65, 192, 2, 6, 64)
    idx = torch.empty(16, 64, dtype=torch.long, device="meta")
    strategies = load_strategy_file("conf/strategy/gpt_mlp_columns.yaml", dp=dp, mp=mp)
    plan = plan_auto_parallel(model, (idx,), device_num=dp * mp, strategies=strategies, data=dp)
    assert plan.strategies["blocks.0.mlp.2"] == ((dp, 1, mp), (1, mp))
