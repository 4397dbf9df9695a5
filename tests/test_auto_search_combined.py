"""Both searches combined with the rest of a job (issue 15): a memory limit in the recursive
planner, optimizer parallel's data axis and memory saving, and pipeline stages planned each on
their own ranks with a tied parameter laid out alike on both sides."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from parallel import ParallelConfig
from parallel.auto.cost_model import DEFAULT_PROFILES
from parallel.auto.graph import capture_ops
from parallel.auto.plan import plan_auto_parallel, stage_of_ops
from parallel.auto.propagate import PricedGraph
from parallel.auto.recursive_programming import search as recursive_search
from recipes.gpt import GPT

PROFILE = DEFAULT_PROFILES["cpu"]
SEARCHES = ["dynamic_programming", "recursive_programming"]
GPT_STAGES = {"tok_emb": 0, "pos_emb": 0, "blocks.0": 0, "blocks.1": 1, "ln_f": 1, "lm_head": 1}


def _gpt() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return GPT(65, 192, 2, 6, 64), (torch.randint(0, 65, (16, 64)),)


def test_the_recursive_planner_keeps_a_memory_limit():
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    inputs = torch.randn(4096, 64)  # activations outweigh weights: splitting them saves memory
    ops = capture_ops(model, (inputs,))
    prices = PricedGraph(ops, 4, PROFILE)
    memory = [sum(c.memory for c in choice) for choice in itertools.product(*prices.options)]
    free, _ = recursive_search(ops, 4, PROFILE)
    used = sum(d.candidate.memory for d in free)
    limit = (used + min(memory)) / 2  # the unlimited plan does not fit; some plan does
    assert used > limit
    decisions, notes = recursive_search(ops, 4, PROFILE, max_device_memory=limit)
    assert sum(d.candidate.memory for d in decisions) <= limit
    assert "memory limit" in notes[-1]
    with pytest.raises(ValueError, match="cannot be met on 4 devices; the least memory"):
        recursive_search(ops, 4, PROFILE, max_device_memory=min(memory) / 2)


@pytest.mark.parametrize("search_mode", SEARCHES)
def test_optimizer_parallel_keeps_a_data_axis_and_its_memory_is_counted(search_mode):
    model, idx = _gpt()
    plans = {level: plan_auto_parallel(model, idx, device_num=4, search_mode=search_mode,
                                       data=2, optimizer_level=level)
             for level in (None, "level1", "level3")}
    for plan in plans.values():
        for op in plan.ops:
            assert op.strategy[0][0] % 2 == 0, op  # the batch over the 2 data ranks at least
    params = sum(p.numel() for p in model.parameters()) * 4
    # the moments (half the 4 copies) of every replicated slice are sharded over 2 ranks
    assert plans["level1"].memory < plans[None].memory - params / 2 / 2 / 2
    assert plans["level3"].memory < plans["level1"].memory
    gathers = [c for op in plans["level3"].ops for c in op.comms if c.kind == "all_gather"]
    assert len(gathers) > len([c for op in plans["level1"].ops for c in op.comms
                               if c.kind == "all_gather"])


def test_operators_follow_their_module_into_its_pipeline_stage():
    model, idx = _gpt()
    ops = capture_ops(model, idx)
    stages = stage_of_ops(ops, GPT_STAGES)
    assert stages == sorted(stages) and set(stages) == {0, 1}
    for op, stage in zip(ops, stages, strict=True):
        if op.module.startswith(("blocks.1", "ln_f", "lm_head")):
            assert stage == 1
        elif op.module:
            assert stage == 0
    root = [s for op, s in zip(ops, stages, strict=True) if not op.module]
    assert root and set(root) == {0}  # tok + pos embeddings add in the root's forward


@pytest.mark.parametrize("search_mode", SEARCHES)
def test_pipeline_stages_are_planned_apart_and_ties_agree(search_mode):
    model, idx = _gpt()
    plan = plan_auto_parallel(model, idx, device_num=4, search_mode=search_mode,
                              stages=GPT_STAGES)
    whole = plan_auto_parallel(model, idx, device_num=4, search_mode=search_mode)
    assert set(plan.stage_memory) == {0, 1}
    assert plan.memory == max(plan.stage_memory.values()) < whole.memory
    by_key = {op.key: op for op in plan.ops}
    # the tied embedding and head: one weight layout on both stages (the pipeline all-reduces
    # their gradients shard by shard)
    emb_weight = by_key["tok_emb"].strategy[1]
    assert by_key["lm_head"].strategy[1] == emb_weight
    first_of_stage_1 = next(op for op in plan.ops if op.stage == 1)
    assert not [c for c in first_of_stage_1.comms if not c.backward]  # its input arrives whole
    assert "stage 1:" in plan.explain()
    limit = plan.memory * 0.9
    limited = plan_auto_parallel(model, idx, device_num=4, search_mode=search_mode,
                                 stages=GPT_STAGES, max_device_memory=limit)
    assert limited.memory <= limit
    with pytest.raises(ValueError, match="cannot be met on stage 0's 4 devices"):
        plan_auto_parallel(model, idx, device_num=4, search_mode=search_mode,
                           stages=GPT_STAGES, max_device_memory=1024)


@pytest.mark.parametrize("kwargs, match", [
    (dict(tensor_degree=2), "leave tensor_degree=1 \\(with enable_parallel_optimizer"),
    (dict(max_device_memory=2**30), "max_device_memory bounds the plan of"),
    (dict(search_mode="dynamic_programming", max_device_memory=-1.0), "positive number of bytes"),
    (dict(expert_degree=2, enable_parallel_optimizer=True),
     "auto × expert × optimizer is unsupported"),
])
def test_impossible_auto_configs_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**{"search_mode": "sharding_propagation", **kwargs})


def test_a_data_axis_that_does_not_divide_the_devices_is_refused():
    model, idx = _gpt()
    with pytest.raises(ValueError, match="data=3 must be a positive divisor of device_num=4"):
        plan_auto_parallel(model, idx, device_num=4, data=3)
    with pytest.raises(ValueError, match="optimizer_level 'zero2' is not one of"):
        plan_auto_parallel(model, idx, device_num=4, data=2, optimizer_level="zero2")
    assert math.isfinite(plan_auto_parallel(model, idx, device_num=4, data=4).cost)
