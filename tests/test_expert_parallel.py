"""Expert parallel MoE on 2 and 4 gloo ranks (ep=2, and ep=2 × dp=2) against one MoE with the
same weights on the concatenated batch: forward, the balancing loss, dropped counts and every
gradient, in capacity and dropless modes, top-1 and top-2; and the in-layer copies."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import hetero
import parallel
from comm_counter import collectives
from distributed import run_ranks
from parallel import ParallelConfig
from parallel.nn import MoE

D, TOKENS = 8, 12  # tokens per rank


def _model(top_k: int, dropless: bool, capacity_factor: float = 1.0) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), MoE(D, 16, 4, top_k=top_k, dropless=dropless,
                                              capacity_factor=capacity_factor))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _step(model: nn.Module, moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = model(x)
    (out.square().mean() + moe.aux_loss).backward()
    return out, moe.aux_loss.detach()


def _compare(rank: int, world: int, ep: int, top_k: int, dropless: bool, copies: int = 1,
             capacity_factor: float = 1.0, host: bool = False) -> dict:
    reference = _model(top_k, dropless, capacity_factor)
    model = copy.deepcopy(reference)
    model[1].copies = copies
    if host:  # experts in host memory: hybrid placement leaves them to the MoE layer
        hetero.set_device(model[1].experts, "cpu")
    x = torch.randn(TOKENS * world, D, generator=torch.Generator().manual_seed(1))
    want_out, want_aux = _step(reference, reference[1], x)
    wrapped = parallel.parallelize(model, ParallelConfig(expert_degree=ep)).model
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
    result = []
    comms = collectives(lambda: result.extend(_step(wrapped, model[1], x[mine])))
    out, aux = result
    torch.testing.assert_close(out, want_out[mine], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(aux, want_aux, rtol=1e-5, atol=1e-7)
    assert model[1].dropped == reference[1].dropped
    assert torch.equal(model[1].load, reference[1].load)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(_full(p.grad), q.grad, rtol=1e-5, atol=1e-6, msg=name)
    return {"dropped": model[1].dropped, "sharded": isinstance(model[1].experts.w1, DTensor),
            "local_experts": model[1].experts.w1.to_local().shape[0], "comms": comms}


def _all_modes(rank: int, world: int, ep: int) -> list[dict]:
    parallel.init()
    return [_compare(rank, world, ep, top_k, dropless)
            for top_k in (1, 2) for dropless in (False, True)] + [
        _compare(rank, world, ep, 2, False, host=True)]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_equals_one_moe_on_the_whole_batch(world):
    results = run_ranks(_all_modes, world, 2, timeout=240)
    for rank_results in results:
        assert [r["dropped"] > 0 for r in rank_results] == [True, False, True, False, True]
        assert all(r["sharded"] and r["local_experts"] == 2 for r in rank_results)


def _crowded(rank: int, world: int) -> tuple[int, int]:
    """Every token's first choice is expert 0: capacity keeps ceil(k·N·f/E) of them."""
    parallel.init()
    model = _model(1, False, capacity_factor=1.0)
    with torch.no_grad():
        model[1].router.gate.weight.zero_()
        model[1].router.gate.weight[0] = 1.0
        model[0].weight.copy_(torch.eye(D))
        model[0].bias.fill_(1.0)
    wrapped = parallel.parallelize(model, ParallelConfig(expert_degree=2)).model
    wrapped(torch.rand(TOKENS, D))
    return model[1].dropped, int(model[1].load[0])


@pytest.mark.slow
def test_dropped_choices_follow_the_capacity_formula_over_the_global_batch():
    results = run_ranks(_crowded, 4)
    tokens = 4 * TOKENS
    cap = -(-1 * tokens * 1.0 // 4)  # ceil(k · N · f / E)
    assert results == [(tokens - cap, tokens)] * 4


def _copies(rank: int, world: int) -> dict:
    parallel.init()
    return {copies: _compare(rank, world, 2, 2, True, copies=copies)["comms"]
            for copies in (1, 2)}


@pytest.mark.slow
def test_in_layer_copies_equal_one_copy_and_double_the_exchanges():
    """Two copies compute the same as one (checked in _compare), with twice the all-to-alls
    (dispatch and combine, forward and backward) carrying half the rows in all."""
    for comms in run_ranks(_copies, 2):
        one, two = comms[1]["all_to_all_single"], comms[2]["all_to_all_single"]
        assert len(two) == 2 * len(one)
        assert sum(two) == sum(one)  # the same rows, split in two
        assert len(comms[2]["all_gather_into_tensor"]) == 1  # routing agreed once, not per copy


def _refusals(rank: int, world: int) -> list[str]:
    parallel.init()
    messages = []
    for model, config in ((nn.Linear(4, 4), ParallelConfig(expert_degree=2)),
                          (MoE(4, 8, 3), ParallelConfig(expert_degree=2))):
        try:
            parallel.parallelize(model, config)
        except ValueError as err:
            messages.append(str(err))
    return messages


@pytest.mark.slow
def test_bad_expert_settings_are_refused_by_name():
    messages = run_ranks(_refusals, 2)[0]
    assert "has none" in messages[0]
    assert "must divide the experts" in messages[1] and "num_experts=3" in messages[1]
    # one replica of each expert shard: data_degree=1 splits the batch over the expert ranks
    assert ParallelConfig(data_degree=1, expert_degree=2).resolve(2).batch_ranks == 2
    with pytest.raises(ValueError, match="expert × pipeline × tensor is unsupported"):
        ParallelConfig(strategy_tags=True, expert_degree=2, pipeline_degree=2)
    with pytest.raises(ValueError, match="does not divide the world"):
        ParallelConfig(expert_degree=3).resolve(4)


def test_host_experts_stay_on_the_host_through_device_moves_and_compute_alike():
    torch.manual_seed(0)
    device_moe = MoE(D, 16, 4)
    host_moe = copy.deepcopy(device_moe)
    hetero.set_device(host_moe.experts, "cpu")
    host_moe.to(torch.float64)
    device_moe.to(torch.float64)
    assert host_moe.experts.w1.dtype == torch.float64  # dtype changes still apply
    x = torch.randn(10, D, dtype=torch.float64)
    torch.testing.assert_close(host_moe(x), device_moe(x))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_host_experts_on_a_gpu_model_keep_their_weights_in_host_memory():
    torch.manual_seed(0)
    reference = MoE(D, 16, 4)
    moe = copy.deepcopy(reference)
    hetero.set_device(moe.experts, "cpu")
    moe.to("cuda")
    assert moe.experts.w1.device.type == "cpu" and moe.router.gate.weight.is_cuda
    x = torch.randn(10, D)
    out = moe(x.cuda())
    assert out.is_cuda
    torch.testing.assert_close(out.cpu(), reference(x), rtol=1e-5, atol=1e-6)
