"""Semi-auto parallel on 2 and 4 gloo ranks against the same model run in one process.

Each rank builds the single-device model and its semi-auto copy from the same seed, runs both and
returns what the test compares: outputs, gradients, the collectives CommDebugMode saw between the
reference's two MatMuls, and explain_sharding's account. One spawn per world size keeps it fast.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.debug import CommDebugMode

import parallel
from distributed import run_ranks

# ----------------------------------------------------------------------------- models


class ZNet(nn.Module):
    """The reference's Z = (X x W) x V with two sharded MatMuls (plain ones without strategies)."""

    def __init__(self, first=None, second=None, second_out=None) -> None:
        super().__init__()
        self.w, self.v = nn.Parameter(torch.randn(8, 16)), nn.Parameter(torch.randn(16, 8))
        self.matmul1 = parallel.shard(torch.matmul, first) if first else torch.matmul
        self.matmul2 = parallel.shard(torch.matmul, second, second_out) if second else torch.matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul2(self.matmul1(x, self.w), self.v)


class MLP(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-LN transformer block with separate q/k/v projections (head-aligned column split)."""

    def __init__(self, d: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d) for _ in range(4))
        self.mlp = MLP(d)
        self.attend = F.scaled_dot_product_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (w(h).view(b, t, self.heads, -1).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        a = self.attend(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.wo(a)
        return x + self.mlp(self.ln2(x))


def megatron_block(block: Block, dp: int, mp: int) -> Block:
    """Data x model parallel: columns/rows of the Linears over mp, heads over mp, batch over dp.
    The LayerNorms use an explicit Layout so their batch split lands on the dp axis."""
    layout = parallel.semi_auto.Layout((dp, mp), ("dp", "mp"))
    for norm in (block.ln1, block.ln2):
        parallel.shard(norm, (layout("dp", "None", "None"),))
    for proj in (block.wq, block.wk, block.wv, block.mlp.fc1):
        parallel.shard(proj, ((dp, 1, 1), (mp, 1)))
    for proj in (block.wo, block.mlp.fc2):
        parallel.shard(proj, ((dp, 1, mp), (1, mp)))
    parallel.shard(block.mlp.act, ((dp, 1, mp),))
    block.attend = parallel.shard(F.scaled_dot_product_attention, ((dp, mp, 1, 1),) * 3)
    return block


class TiedLM(nn.Module):
    """An embedding whose table is also the output head (the GPT recipe's tied weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mix = nn.Embedding(16, 8), nn.Linear(8, 8)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(self.mix(self.emb(idx))), self.emb.weight)


# ----------------------------------------------------------------------------- rank bodies


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
            for n, p in model.named_parameters()}


def _compare(ref: nn.Module, par: nn.Module, *inputs: torch.Tensor) -> dict:
    """Forward and backward both models on ``inputs``; what the test compares."""
    out, want = par(*inputs), ref(*inputs)
    out.square().sum().backward()
    want.square().sum().backward()
    return {"out": out.detach(), "want": want.detach(), "grads": _grads(par),
            "want_grads": _grads(ref), "plain_output": type(out) is torch.Tensor}


def _counts(mode: CommDebugMode) -> dict[str, int]:
    return {str(k).split(".")[-1]: v for k, v in mode.get_comm_counts().items()}


def _sample(first, second, second_out=None) -> dict:
    torch.manual_seed(0)
    ref = ZNet()
    net = ZNet(first, second, second_out)
    net.load_state_dict(ref.state_dict())
    parallel.parallelize(net, parallel.ParallelConfig())
    x = torch.randn(4, 8)
    result = _compare(ref, net, x)
    mesh = net.w.device_mesh
    y = net.matmul1(DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim), net.w)
    with CommDebugMode() as between:
        net.matmul2(y, net.v)
    result.update(comms=_counts(between), explain=parallel.semi_auto.explain_sharding(net),
                  cpu=mesh.device_type == "cpu")
    return result


def _two_ranks(rank: int, world: int) -> dict:
    parallel.init()
    results = {"sample1": _sample(((2, 1), (1, 1)), ((1, 1), (1, 2))),
               "sample2": _sample(((1, 1), (1, 2)), ((2, 1), (1, 1)))}
    torch.manual_seed(1)
    ref = MLP()
    mlp = copy.deepcopy(ref)
    parallel.context.set_auto_parallel_context(
        parallel_mode=parallel.context.ParallelMode.SEMI_AUTO_PARALLEL)
    parallel.parallelize(mlp, parallel.ParallelConfig.from_context(strategies={  # Megatron
        "fc1": ((1, 1, 1), (2, 1)), "act": ((1, 1, 2),),
        "fc2": {"in_strategy": ((1, 1, 2), (1, 2)), "out_strategy": ((1, 1, 1),)}}))
    x = torch.randn(2, 4, 16)
    results["mlp"] = _compare(ref, mlp, x)
    results["mlp_local_weight"] = tuple(mlp.fc1.weight.to_local().shape)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1) for m in (ref, mlp)]
    for _ in range(2):
        for model, opt in zip((ref, mlp), opts, strict=True):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    results["mlp_trained"] = ({n: p.detach() for n, p in ref.named_parameters()},
                              {n: p.full_tensor().detach() for n, p in mlp.named_parameters()})
    torch.manual_seed(2)
    ref = TiedLM()
    lm = copy.deepcopy(ref)
    parallel.parallelize(lm, parallel.ParallelConfig(strategies={
        "emb": ((2, 1), (1, 1)), "mix": ((1, 1, 1), (2, 1))}))  # tied table stays replicated
    results["tied"] = _compare(ref, lm, torch.randint(0, 16, (4, 3)))
    results["tied_explain"] = parallel.semi_auto.explain_sharding(lm)
    torch.manual_seed(3)
    ref = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8))
    vocab = parallel.parallelize(copy.deepcopy(ref), parallel.ParallelConfig(strategies={
        "0": ((1, 1), (2, 1))})).model  # vocabulary-parallel table: DTensor's masked lookup
    results["vocab"] = _compare(ref, vocab, torch.randint(0, 16, (4, 3)))
    shared = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    shared[1].weight = shared[0].weight
    try:
        parallel.parallelize(shared, parallel.ParallelConfig(strategies={
            "0": ((1, 1), (2, 1)), "1": ((1, 2), (1, 2))}))
    except ValueError as err:
        results["tied_conflict"] = str(err)
    return results


def _four_ranks(rank: int, world: int) -> dict:
    parallel.init()
    results = {"sample1": _sample(((2, 1), (1, 1)), ((1, 1), (1, 2))),
               "sample3": _sample(((2, 1), (1, 2)), ((2, 2), (2, 1)), ((2, 1),))}
    torch.manual_seed(4)
    ref = Block()
    block = megatron_block(copy.deepcopy(ref), dp=2, mp=2)
    parallel.parallelize(block, parallel.ParallelConfig())
    x = torch.randn(4, 6, 16)
    results["block"] = _compare(ref, block, x)
    results["block_explain"] = parallel.semi_auto.explain_sharding(block)
    results["block_mesh"] = tuple(block.wq.weight.device_mesh.shape)
    return results


# ----------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def two() -> list[dict]:
    return run_ranks(_two_ranks, 2, timeout=150)


@pytest.fixture(scope="module")
def four() -> list[dict]:
    return run_ranks(_four_ranks, 4, timeout=200)


def _assert_matches(result: dict) -> None:
    assert result["plain_output"]
    torch.testing.assert_close(result["out"], result["want"], rtol=1e-5, atol=1e-5)
    assert result["grads"].keys() == result["want_grads"].keys()
    for name, grad in result["grads"].items():
        torch.testing.assert_close(grad, result["want_grads"][name], rtol=1e-5, atol=1e-5,
                                   msg=lambda m, n=name: f"gradient of {n}: {m}")


@pytest.mark.slow
def test_sample_1_inserts_an_all_gather(two, four):
    for results in (two, four):
        for rank_result in results:
            _assert_matches(rank_result["sample1"])
        assert results[0]["sample1"]["comms"] == {"all_gather_into_tensor": 1}
        assert "input: AllGather(" in results[0]["sample1"]["explain"]


@pytest.mark.slow
def test_sample_2_inserts_an_all_to_all(two):
    for rank_result in two:
        _assert_matches(rank_result["sample2"])
    result = two[0]["sample2"]
    assert "input: AlltoAll(mesh dim 0: S(1) -> S(0))" in result["explain"]
    # DTensor performs Shard(1) -> Shard(0) as all_to_all, except on gloo (CPU) meshes where it
    # falls back to all_gather + local chunk: still one collective, still no AllReduce.
    assert result["comms"] == ({"all_gather_into_tensor": 1} if result["cpu"]
                               else {"all_to_all_single": 1})


@pytest.mark.slow
def test_sample_3_needs_no_redistribution_only_an_all_reduce(four):
    for rank_result in four:
        _assert_matches(rank_result["sample3"])
    result = four[0]["sample3"]
    assert result["comms"] == {"all_reduce": 1}  # the contracting split, nothing for the inputs
    explain = result["explain"]
    assert "communication at the last call: output: AllReduce(mesh dim 1: P(sum) -> R)" in explain
    assert "partial over axes (1,)  -> (S(0), P(sum))" in explain


@pytest.mark.slow
def test_megatron_mlp_matches_one_device_and_trains_alike(two):
    for rank_result in two:
        _assert_matches(rank_result["mlp"])
        assert rank_result["mlp_local_weight"] == (32, 16)  # fc1's 64 rows split over 2 ranks
        want, got = rank_result["mlp_trained"]
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_tied_and_vocabulary_parallel_embeddings(two):
    for rank_result in two:
        _assert_matches(rank_result["tied"])
        _assert_matches(rank_result["vocab"])
    assert "emb.weight                   [16, 8] -> local [16, 8]  (R)  layout of emb" in (
        two[0]["tied_explain"])
    assert "shared (tied) parameter has one layout" in two[0]["tied_conflict"]
    assert "parameter 0.weight is shared by 0 and 1" in two[0]["tied_conflict"]


@pytest.mark.slow
def test_transformer_block_data_times_model_parallel(four):
    for rank_result in four:
        _assert_matches(rank_result["block"])
    assert four[0]["block_mesh"] == (2, 2)
    explain = four[0]["block_explain"]
    assert "attend  [F.scaled_dot_product_attention]" in explain
    assert "mlp.fc2.weight" in explain and "(R, S(1))" in explain
