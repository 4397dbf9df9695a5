"""Multi-copy parallel on 2 gloo ranks: a semi-auto Megatron MLP block run as 2 interleaved
copies equals 1 copy (outputs and gradients), with twice the collectives at half the size; and
the refusals."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import parallel
from comm_counter import collectives
from distributed import run_ranks
from parallel.nn import MoE
from test_semi_auto_parallel import MLP  # the Megatron MLP block semi-auto's own tests use

MEGATRON = {"fc1": ((1, 1, 1), (2, 1)), "act": ((1, 1, 2),),
            "fc2": {"in_strategy": ((1, 1, 2), (1, 2)), "out_strategy": ((1, 1, 1),)}}


def _run(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, list[int]]]:
    result = []

    def step() -> None:
        out = model(x)
        out.square().mean().backward()
        result.append(out.detach())
    calls = collectives(step)
    return result[0], calls


def _semi_auto(rank: int, world: int) -> dict:
    parallel.init()
    torch.manual_seed(1)
    one = MLP()
    two, three = copy.deepcopy(one), copy.deepcopy(one)
    for model in (one, two):
        parallel.parallelize(model, parallel.ParallelConfig(strategies=MEGATRON))
    wrapped = parallel.multi_copy(two, copies=2)
    x = torch.randn(4, 6, 16)
    want, calls_one = _run(one, x)
    got, calls_two = _run(wrapped, x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    for (name, p), q in zip(two.named_parameters(), one.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad.full_tensor(), rtol=1e-6,
                                   atol=1e-7, msg=name)
    # auto × multi_copy: the planned model, copies from the config, the same outputs and grads
    auto = parallel.parallelize(three, parallel.ParallelConfig(
        search_mode="sharding_propagation", strategies={"fc1": ((1, 1, 1), (2, 1))}, multi_copy=2),
        example_inputs=(x,)).model
    got_auto, _ = _run(auto, x)
    torch.testing.assert_close(got_auto, want, rtol=1e-6, atol=1e-7)
    for (name, p), q in zip(three.named_parameters(), one.parameters(), strict=True):
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(grad, q.grad.full_tensor(), rtol=1e-6, atol=1e-7, msg=name)
    return {"one": calls_one, "two": calls_two, "kind": type(wrapped).__name__,
            "auto_kind": type(auto).__name__,
            "same_params": list(wrapped.state_dict()) == list(two.state_dict())}


@pytest.mark.slow
def test_two_copies_of_a_semi_auto_block_equal_one_with_twice_the_collectives_at_half_size():
    for r in run_ranks(_semi_auto, 2):
        assert r["kind"] == r["auto_kind"] == "MultiCopy" and r["same_params"]
        one, two = r["one"]["all_reduce"], r["two"]["all_reduce"]
        assert len(two) == 2 * len(one)  # fc2's partial sums (forward), fc1's input grad
        assert sorted(two) == sorted([n // 2 for n in one] * 2)  # each carries half the batch


def test_moe_layers_take_the_copies_in_place():
    moe = MoE(8, 16, 4)
    model = nn.Sequential(nn.Linear(8, 8), moe)
    assert parallel.multi_copy(model, copies=3) is model and moe.copies == 3


@pytest.mark.parametrize("model, copies, match", [
    (nn.Linear(4, 4), 2, "has neither"),
    (nn.Linear(4, 4), 0, "copies must be a positive int"),
    (MoE(4, 8, 2), 1.5, "copies must be a positive int"),
])
def test_impossible_multi_copy_settings_are_refused_by_name(model, copies, match):
    with pytest.raises(ValueError, match=match):
        parallel.multi_copy(model, copies=copies)


def test_parallel_config_refuses_zero_copies():
    with pytest.raises(ValueError, match="multi_copy must be at least 1"):
        parallel.ParallelConfig(multi_copy=0)


def test_moe_layers_are_found_through_wrappers():
    moe = MoE(8, 16, 4)
    parallel.init()
    try:
        wrapped = parallel.data.DataParallel(moe)
        assert parallel.multi_copy(wrapped, copies=2) is wrapped and moe.copies == 2
    finally:
        parallel.destroy()


def test_multi_copy_with_optimizer_parallel_needs_moe_layers_and_changes_nothing():
    parallel.init()
    model = MLP()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="multi_copy with optimizer parallel splits MoE layers"):
        parallel.parallelize(model, parallel.ParallelConfig(enable_parallel_optimizer=True,
                                                            multi_copy=2))
    for name, p in model.named_parameters():
        assert type(p) is nn.Parameter and torch.equal(p, before[name])
