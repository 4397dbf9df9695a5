"""Pipeline combinations on 4 gloo ranks (pipeline 2 × data 2, and pipeline 2 × model 2), each
equal to one process on the same global batch (losses, gradient norms, final parameters):

* optimizer parallel (levels 1–3) with several stages per rank (``interleaved_1f1b``, ``zbv``):
  every stage a rank holds shards its optimizer over the stage's data ranks; ``zbv``'s split
  backward gathers level3 weights again;
* multi-copy inside pipeline stages: each micro-batch of a semi-auto stage runs as 2 copies, whose
  collectives are twice as many at half the size; MoE layers take the copies in place.

One spawn runs every case; the fast tests check what the config accepts and still refuses.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

import parallel
from comm_counter import collectives
from distributed import fsdp_param_groups, run_ranks
from parallel import ParallelConfig
from parallel.config import OperatorSplit
from parallel.nn import MoE
from parallel.optimizer_parallel.chunkwise import GlooAllGather
from parallel.pipeline.copies import check_copies
from parallel.semi_auto import load_strategy_file
from pipeline_helpers import BATCH, SEQ, VOCAB, batch, full_params, gpt_loss, tiny_gpt
from recipes.gpt import GPT
from torch_features import (
    SPMD_SHARDING,
    needs_spmd_sharding,
    needs_zbv_over_gloo,
    runs_here,
    zbv_params,
)

STEPS = 3
OP_CASES = [(level, schedule) for schedule in ("interleaved_1f1b", "zbv")
            for level in ("level1", "level2", "level3")]


def moe_gpt() -> GPT:
    """The tiny GPT with every second block's MLP a dropless MoE (per-token routing: a
    micro-batch's or a copy's tokens route as the whole batch's do)."""
    torch.manual_seed(0)
    return GPT(VOCAB, d_model=16, n_layer=4, n_head=2, block_size=SEQ, dropout=0.0,
               moe={"num_experts": 4, "top_k": 2, "dropless": True}, moe_every=2)


def _megatron(data: int, model: int) -> dict:
    return load_strategy_file("conf/strategy/gpt_megatron.yaml", dp=data, mp=model)


def _op_config(level: str, schedule: str, **fields: Any) -> ParallelConfig:
    return ParallelConfig(**{"pipeline_degree": 2, "micro_batches": 2, "schedule": schedule,
                             "enable_parallel_optimizer": True, "optimizer_level": level,
                             "parallel_optimizer_threshold": 1, **fields})


MC_CASES = {
    # pp × dp, semi-auto's batch axis: each stage's outputs are gathered from the batch shards
    "dp": dict(pipeline_degree=2, data_degree=2, micro_batches=2,
               schedule="1f1b", strategies=_megatron(2, 1)),
    # pp × mp, Megatron MLPs: the row-parallel layers' partial sums are all-reduced
    "mp": dict(pipeline_degree=2, data_degree=1, tensor_degree=2,
               micro_batches=2, schedule="interleaved_1f1b", strategies=_megatron(1, 2)),
}
#: the forward collective each case's copies split (gradient reductions run once per backward)
SPLIT = {"dp": "all_gather_into_tensor", "mp": "all_reduce"}


def _gathers(fn) -> int:
    """FSDP2 all-gathers ``fn`` issues: c10d's own (which the functional-collective counter
    does not see), or on gloo the chunkwise ones (``GlooAllGather`` calls)."""
    chunkwise = []
    real = GlooAllGather.__call__

    def counting(self, *args, **kwargs):
        chunkwise.append(1)
        return real(self, *args, **kwargs)

    GlooAllGather.__call__ = counting
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
    finally:
        GlooAllGather.__call__ = real
    return len(chunkwise) + sum(e.name == "c10d::_allgather_base_" for e in prof.events())


def _train(config: ParallelConfig, count: str | None = None,
           build: Callable[[], torch.nn.Module] = tiny_gpt) -> dict:
    """Losses, whole-model gradient norms and final parameters after ``STEPS`` AdamW steps under
    ``config``; each data rank feeds its slice unless semi-auto feeds every rank the batch.
    ``count``: also measure the second step's FSDP2 all-gathers ("gathers") or functional
    collectives ("collectives")."""
    pipe = parallel.parallelize(build(), config, loss_fn=gpt_loss).model
    resolved = config.resolve(parallel.get_world_size())
    slices = resolved.operator_split is OperatorSplit.REPLICAS or not resolved.full_batch
    per = BATCH // resolved.data if slices else BATCH
    start = parallel.mesh.parallel_mesh(resolved)["dp"].get_local_rank() * per if slices else 0
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    out: dict = {"losses": [], "norms": []}
    for step in range(STEPS):
        x, y = (t[start:start + per] for t in batch(step))
        opt.zero_grad()

        def run(x=x, y=y) -> None:
            out["losses"].append(pipe.step(x, target=y).item())
        if step == 1 and count == "gathers":
            out["gathers"] = _gathers(run)
        elif step == 1 and count == "collectives":
            out["collectives"] = collectives(run)
        else:
            run()
        out["norms"].append(float(pipe.clip_grad_norm_(1e9)))  # AdamW would hide a scale
        opt.step()
    out["params"] = full_params(pipe)
    names = dict(pipe.named_parameters())
    out["sharded"] = sorted(n for n, p in names.items() if isinstance(p, DTensor)
                            and any(pl.is_shard() for pl in p.placements))
    dp = pipe.data_parallel
    out["replicated"] = list(getattr(dp, "replicated", []))
    out["stage_types"] = [type(s.submod.stage).__name__ for s in pipe.stages]
    out["moe_copies"] = [m.copies for m in pipe.modules() if isinstance(m, MoE)]
    out["pp_rank"] = parallel.mesh.parallel_mesh(resolved)["pp"].get_local_rank()
    out["on_host"] = [param.offload_to_cpu  # FSDP2's own record of each unit's parameters
                      for unit in pipe.modules() if isinstance(unit, FSDPModule)
                      for group in fsdp_param_groups(unit)
                      for param in group.fsdp_params]
    return out


def _one_step_collectives(config: ParallelConfig) -> dict[str, list[int]]:
    pipe = parallel.parallelize(tiny_gpt(), config, loss_fn=gpt_loss).model
    x, y = batch(1)
    pipe.step(x, target=y)  # the first step also runs the split check
    return collectives(lambda: pipe.step(x, target=y))


def _suite(rank: int, world: int) -> dict:
    parallel.init()
    out: dict = {}
    for level, schedule in filter(runs_here, OP_CASES):
        out[(level, schedule)] = _train(_op_config(level, schedule),
                                        count="gathers" if schedule == "zbv" else None)
    if SPMD_SHARDING is None:
        out["semi_auto_op"] = _train(_op_config(
            "level1", "interleaved_1f1b", data_degree=2, full_batch=False,
            parallel_optimizer_threshold=0, strategies=_megatron(2, 1)))
    for name, fields in MC_CASES.items():
        out[("copies", name)] = _train(ParallelConfig(multi_copy=2, **fields),
                                       count="collectives")
        out[("one_copy", name)] = _one_step_collectives(ParallelConfig(**fields))
    out["moe"] = _train(ParallelConfig(pipeline_degree=2, micro_batches=2, multi_copy=2),
                        build=moe_gpt)
    out["host_shards"] = _train(_op_config("level3", "interleaved_1f1b", offload_params=True))
    return out


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_ranks(_suite, 4, timeout=600)


def _one_process(model: torch.nn.Module, micro: list[list[int]] | None = None) -> dict:
    """One process on the whole batch (or, with ``micro``, on those groups of its rows, one
    backward each, as a pipeline's micro-batches): per-step losses and gradient norms, final
    parameters."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        total = 0.0
        for rows in micro or [list(range(BATCH))]:
            _, loss = model(x[rows], y[rows])  # with MoE layers: their balancing losses
            (loss / len(micro or [rows])).backward()
            total += loss.item() / len(micro or [rows])
        losses.append(total)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
        opt.step()
    return {"losses": losses, "norms": norms,
            "params": {n: p.detach().clone() for n, p in model.state_dict().items()}}


@pytest.fixture(scope="module")
def want() -> dict:
    return _one_process(tiny_gpt())


def _assert_like_one_process(result: dict, want: dict) -> None:
    assert result["losses"] == pytest.approx(want["losses"], rel=1e-5)
    assert result["norms"] == pytest.approx(want["norms"], rel=1e-5)
    for name, value in result["params"].items():
        # atol: the attention key bias, whose true gradient is 0 (test_pipeline._assert_matches)
        torch.testing.assert_close(value, want["params"][name], rtol=1e-5, atol=5e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("level, schedule", zbv_params(OP_CASES))
def test_optimizer_parallel_with_several_stages_per_rank_trains_like_one_process(
        four_ranks, want, level, schedule):
    for result in four_ranks:
        r = result[(level, schedule)]
        _assert_like_one_process(r, want)
        assert r["sharded"] and all(".attn.qkv.weight" not in n for n in r["replicated"])
        # zbv puts the tied embedding and head on pipeline rank 0, in two stages (two FSDP2
        # roots): it stays replicated there; interleaved puts them on different ranks
        if "tok_emb.weight" in r["params"]:
            assert ("tok_emb.weight" in r["replicated"]) == (schedule == "zbv")
            assert ("tok_emb.weight" in r["sharded"]) == (schedule != "zbv")


@pytest.mark.slow
def test_stages_with_their_shards_on_the_host_train_like_one_process(four_ranks, want):
    for result in four_ranks:
        r = result["host_shards"]
        _assert_like_one_process(r, want)
        assert r["on_host"] and all(r["on_host"]), "every FSDP2 unit of the stage offloaded"
        assert not any(result[("level3", "interleaved_1f1b")]["on_host"])


@pytest.mark.slow
@needs_zbv_over_gloo
def test_zbv_level3_gathers_the_weights_again_for_its_split_backward(four_ranks):
    for result in four_ranks:
        assert result[("level3", "zbv")]["gathers"] > result[("level2", "zbv")]["gathers"]


@pytest.mark.slow
@needs_spmd_sharding
def test_semi_auto_stages_shard_their_optimizer_with_several_stages_per_rank(four_ranks, want):
    for result in four_ranks:
        _assert_like_one_process(result["semi_auto_op"], want)
        assert result["semi_auto_op"]["sharded"]


@pytest.mark.slow
@pytest.mark.parametrize("name", MC_CASES)
def test_multi_copy_stages_train_like_one_process_with_collectives_split_in_two(
        four_ranks, want, name):
    for result in four_ranks:
        r = result[("copies", name)]
        _assert_like_one_process(r, want)
        assert set(r["stage_types"]) == {"MultiCopy"}
        two, one = r["collectives"], result[("one_copy", name)]
        assert set(two) == set(one) and SPLIT[name] in one
        for op in one:  # the forward collectives twice at half the size, the others unchanged
            split = sorted([n // 2 for n in one[op]] * 2) if op == SPLIT[name] else sorted(one[op])
            assert sorted(two[op]) == split, op


@pytest.mark.slow
def test_moe_layers_of_the_stages_take_the_copies_and_train_like_one_process(four_ranks):
    # each balancing loss is over one micro-batch: the 2 data ranks' m-th quarters of the batch
    q, half = BATCH // 4, BATCH // 2
    want = _one_process(moe_gpt(), [[*range(m * q, (m + 1) * q),
                                     *range(half + m * q, half + (m + 1) * q)] for m in range(2)])
    for result in four_ranks:
        _assert_like_one_process(result["moe"], want)
        assert result["moe"]["moe_copies"] == [2]  # each rank holds one of the 2 MoE blocks


# ---------------------------------------------------------------- fast: what the config takes
def test_the_config_accepts_these_pipeline_combinations():
    for level, schedule in OP_CASES:
        assert _op_config(level, schedule).schedule == schedule
    for fields in MC_CASES.values():
        assert ParallelConfig(multi_copy=2, **fields).multi_copy == 2
    assert ParallelConfig(pipeline_degree=2, multi_copy=2).multi_copy == 2


@pytest.mark.parametrize("fields, match", [
    (dict(strategy_tags=True, schedule="zbv", enable_parallel_optimizer=True),
     "zbv splits backward into input and weight passes"),
    (dict(search_mode="sharding_propagation", expert_degree=2),
     "auto × expert × pipeline is unsupported"),
])
def test_what_stays_refused_is_named(fields, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(pipeline_degree=2, **fields)


def test_copies_with_nothing_to_overlap_are_refused_before_the_split():
    model = tiny_gpt()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="multi_copy=2 with pipeline_degree=2: copies overlap a "
                                         "stage's semi-auto redistributions or MoE all-to-alls, "
                                         "and this model has neither \\(its operators split: "
                                         "replicas"):
        check_copies(model, ParallelConfig(pipeline_degree=2, multi_copy=2))
    with pytest.raises(ValueError, match=r"model has neither \(its operators split: strategies"):
        check_copies(model, ParallelConfig(strategy_tags=True, pipeline_degree=2,
                                           multi_copy=2))
    check_copies(model, ParallelConfig(pipeline_degree=2, multi_copy=2, **{
        k: v for k, v in MC_CASES["dp"].items() if k != "pipeline_degree"}))
    moe = MoE(16, 32, 4)
    check_copies(torch.nn.Sequential(torch.nn.Linear(16, 16), moe),
                 ParallelConfig(pipeline_degree=2, multi_copy=2))
    assert moe.copies == 1  # only checked: the copies are set once the stages are built
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
