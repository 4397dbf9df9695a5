"""Expert parallel combined with pipeline, optimizer parallel, semi-auto (tensor) and auto
parallel: the recipe GPT with MoE blocks trains on 4 gloo ranks with the losses, gradient norms
and final parameters of one process on the same global batch (rel 1e-5).

Capacity and the balancing loss are counted over the global batch of each forward, so the one
process runs what the ranks run together: under a pipeline (or accumulation) each micro-batch is
the concatenation, in batch-rank order, of every rank's micro-batch. All cases share one spawn of
4 ranks; the one-process references run in the test process."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import parallel
from distributed import run_ranks
from parallel import ParallelConfig
from parallel.auto.apply import auto_limits
from parallel.config import OperatorSplit
from parallel.grad_clip import clip_grad_norm_
from parallel.mesh import batch_mesh
from parallel.nn import MoE
from parallel.pipeline import make_plan
from parallel.semi_auto import load_strategy_file
from recipes.gpt import GPT, lm_loss
from torch_features import runs_here, zbv_params

VOCAB, SEQ, BATCH, MICRO, STEPS = 37, 8, 8, 2, 3
STRATEGY = "conf/strategy/gpt_megatron.yaml"
HUGE = 1e9  # a clipping bound never reached: the returned norm is checked, nothing is clipped


def moe_gpt(n_layer: int, moe_every: int) -> GPT:
    torch.manual_seed(0)
    return GPT(VOCAB, d_model=16, n_layer=n_layer, n_head=2, block_size=SEQ, dropout=0.0,
               moe=dict(num_experts=4, top_k=2, capacity_factor=1.0, aux_loss_factor=0.05),
               moe_every=moe_every)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


def _micro(t: torch.Tensor, ranks: int, m: int) -> torch.Tensor:
    """Micro-batch ``m`` as the ranks feed it together: each rank's slice cut in MICRO."""
    return torch.cat([part.chunk(MICRO)[m] for part in t.chunk(ranks)])


def reference(n_layer: int, moe_every: int, ranks: int | None
              ) -> tuple[list[float], dict, list[float]]:
    """One process: AdamW steps over MICRO micro-batches arranged for ``ranks`` batch ranks
    (None: the whole batch at once); losses, final parameters, gradient norms."""
    model = moe_gpt(n_layer, moe_every)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = batch(step)
        parts = [(x, y)] if ranks is None else [
            (_micro(x, ranks, m), _micro(y, ranks, m)) for m in range(MICRO)]
        total = 0.0
        for xm, ym in parts:
            _, loss = model(xm, ym)
            (loss / len(parts)).backward()
            total += loss.item() / len(parts)
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), HUGE)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, _full_state(model), norms


# ---------------------------------------------------------------- the ranks
def _pipeline_loss(output, target: torch.Tensor) -> torch.Tensor:
    return lm_loss(output[0] if isinstance(output, tuple) else output, target)


def _pipelined(config: ParallelConfig) -> tuple[list[float], dict, dict]:
    pipe = parallel.parallelize(moe_gpt(4, 2), config, loss_fn=_pipeline_loss).model
    resolved = config.resolve(dist.get_world_size())
    mine = batch_mesh(resolved).get_local_rank()
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = (t.chunk(resolved.batch_ranks)[mine] for t in batch(step))
        opt.zero_grad()
        losses.append(pipe.step(x, target=y).item())
        norms.append(float(pipe.clip_grad_norm_(HUGE)))
        opt.step()
    moes = [m for m in pipe.modules() if isinstance(m, MoE)]
    return losses, _full_state(pipe), {"norms": norms, "local_experts": [
        m.experts.w1.to_local().shape[0] if isinstance(m.experts.w1, DTensor) else
        m.experts.w1.shape[0] for m in moes]}


def _optimizer_sharded(config: ParallelConfig) -> tuple[list[float], dict, dict]:
    model = parallel.parallelize(moe_gpt(2, 1), config).model
    resolved = config.resolve(dist.get_world_size())
    ranks = batch_mesh(resolved)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms, dropped = [], [], 0
    for step in range(STEPS):
        x, y = (t.chunk(resolved.batch_ranks)[ranks.get_local_rank()] for t in batch(step))
        total = torch.zeros(())
        for m, (xm, ym) in enumerate(zip(x.chunk(MICRO), y.chunk(MICRO), strict=True)):
            _, loss = model(xm, ym)
            if m < MICRO - 1:
                with model.no_sync():
                    (loss / MICRO).backward()
            else:
                (loss / MICRO).backward()
            total += loss.detach() / MICRO
            dropped += model.blocks[0].mlp.dropped
        norms.append(float(model.clip_grad_norm_(HUGE)))
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total, group=ranks.get_group())  # each rank's loss is its slice's
        losses.append(total.item() / resolved.batch_ranks)
    return losses, _full_state(model), {"explain": model.explain(), "dropped": dropped,
                                        "norms": norms}


def _semi_auto(config: ParallelConfig) -> tuple[list[float], dict, dict]:
    """Semi-auto strategies, or auto's plan made on the dense parts (the MoE layers left out)."""
    auto = config.operator_split is OperatorSplit.SEARCH
    model = parallel.parallelize(moe_gpt(2, 2), config,
                                 example_inputs=(batch(0)[0],) if auto else None).model
    resolved = config.resolve(dist.get_world_size())
    mine = batch_mesh(resolved).get_local_rank()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = batch(step)
        if not resolved.full_batch:  # the dataset strategy: each batch rank feeds its slice
            x, y = (t.chunk(resolved.batch_ranks)[mine] for t in (x, y))
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        # three kinds of gradient: DTensors on the semi-auto mesh, experts on ep, the router's
        norms.append(float(clip_grad_norm_(model.parameters(), HUGE)))
        opt.step()
        losses.append(loss.item())
    moe, dense = model.blocks[1].mlp, model.blocks[0].mlp[0].weight
    return losses, _full_state(model), {
        "norms": norms,
        "local_experts": moe.experts.w1.to_local().shape[0]
        if isinstance(moe.experts.w1, DTensor) else moe.experts.w1.shape[0],
        "dense_rows_split": [p.is_shard(0) for p in dense.placements]}


def _semi_auto_config(model: int, expert: int, full_batch: bool = True) -> ParallelConfig:
    dp = 4 // model
    return ParallelConfig(tensor_degree=model, expert_degree=expert,
                          full_batch=full_batch,
                          strategies=load_strategy_file(STRATEGY, dp=dp, mp=model))


OPTIMIZER = dict(enable_parallel_optimizer=True)
CASES = {  # name -> (rank function, config, the reference's batch ranks)
    "pp2×ep2 1f1b": (_pipelined, ParallelConfig(pipeline_degree=2, expert_degree=2,
                                                micro_batches=MICRO), 2),
    "pp2×ep2 zbv": (_pipelined, ParallelConfig(pipeline_degree=2, expert_degree=2,
                                               micro_batches=MICRO, schedule="zbv"), 2),
    "pp2×dp2 MoE (expert_degree=1)": (_pipelined, ParallelConfig(pipeline_degree=2,
                                                                 micro_batches=MICRO), 2),
    "pp2×ep2 + optimizer level1": (_pipelined, ParallelConfig(
        pipeline_degree=2, expert_degree=2, micro_batches=MICRO, optimizer_level="level1",
        parallel_optimizer_threshold=0, **OPTIMIZER), 2),
    "ep2×dp2 optimizer level1, all under the threshold": (_optimizer_sharded, ParallelConfig(
        expert_degree=2, optimizer_level="level1", **OPTIMIZER), 4),
    "ep2×dp2 optimizer level2": (_optimizer_sharded, ParallelConfig(
        expert_degree=2, optimizer_level="level2", parallel_optimizer_threshold=0, **OPTIMIZER), 4),
    "ep2×dp2 optimizer level3, small ones replicated": (_optimizer_sharded, ParallelConfig(
        expert_degree=2, optimizer_level="level3", parallel_optimizer_threshold=1, **OPTIMIZER), 4),
    "ep2×dp2 optimizer level2 + multi_copy 2": (_optimizer_sharded, ParallelConfig(
        expert_degree=2, optimizer_level="level2", parallel_optimizer_threshold=0,
        multi_copy=2, **OPTIMIZER), 4),
    "ep4 optimizer level2 (dp=1)": (_optimizer_sharded, ParallelConfig(
        expert_degree=4, optimizer_level="level2", parallel_optimizer_threshold=0, **OPTIMIZER), 4),
    "semi-auto mp2×ep2": (_semi_auto, _semi_auto_config(2, 2), None),
    "semi-auto mp2×ep2 dataset strategy": (_semi_auto, _semi_auto_config(2, 2, False), None),
    "semi-auto ep2×dp2 (mp=1)": (_semi_auto, _semi_auto_config(1, 2), None),
    "semi-auto mp2×dp2 MoE (expert_degree=1)": (_semi_auto, _semi_auto_config(2, 1), None),
    "auto mp2×ep2": (_semi_auto, ParallelConfig(tensor_degree=2,
                                                expert_degree=2,
                                                search_mode="dynamic_programming"), None),
    "auto ep2×dp2 (mp=1)": (_semi_auto, ParallelConfig(expert_degree=2,
                                                       search_mode="dynamic_programming"), None),
}
MODELS = {_pipelined: (4, 2), _optimizer_sharded: (2, 1), _semi_auto: (2, 2)}


def _all_cases(rank: int, world: int) -> dict[str, tuple]:
    parallel.init()
    out = {}
    for name, (fn, config, _) in filter(lambda case: runs_here(case[0]), CASES.items()):
        start = time.perf_counter()
        out[name] = (*fn(config), time.perf_counter() - start)
    return out


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, tuple]]:
    return run_ranks(_all_cases, 4, timeout=400)


@pytest.fixture(scope="module")
def want() -> dict[str, tuple[list[float], dict, list[float]]]:
    return {name: reference(*MODELS[fn], ranks) for name, (fn, _, ranks) in CASES.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", zbv_params(CASES))
def test_expert_combination_trains_like_one_process(four_ranks, want, name):
    want_losses, want_params, want_norms = want[name]
    for rank_results in four_ranks:
        losses, params, info, _ = rank_results[name]
        assert losses == pytest.approx(want_losses, rel=1e-5)
        assert info["norms"] == pytest.approx(want_norms, rel=1e-5)  # the global gradient norm
        for key, value in params.items():  # atol: near-zero entries, as in test_pipeline.py
            torch.testing.assert_close(value, want_params[key], rtol=1e-5, atol=5e-5,
                                       msg=lambda m, key=key: f"{name} {key}: {m}")


@pytest.mark.slow
def test_experts_are_sharded_and_the_dense_parts_split(four_ranks):
    first = four_ranks[0]
    assert first["pp2×ep2 1f1b"][2]["local_experts"] == [2]  # this stage's one MoE layer
    assert first["pp2×dp2 MoE (expert_degree=1)"][2]["local_experts"] == [4]
    level2 = first["ep2×dp2 optimizer level2"][2]
    assert "MoE experts: ep=2 shards, each over its 2 replicas (dp × cp)" in level2["explain"]
    assert level2["dropped"] > 0  # capacity bites: equality covers dropped choices too
    assert first["semi-auto mp2×ep2"][2]["local_experts"] == 2
    # the dense MLP's column-parallel weight: replicated on the batch dim, rows split over mp
    assert first["semi-auto mp2×ep2"][2]["dense_rows_split"] == [False, True]
    assert first["semi-auto mp2×dp2 MoE (expert_degree=1)"][2]["local_experts"] == 4
    # auto × expert: the plan made on the dense parts, the MoE layers' experts over ep
    assert first["auto mp2×ep2"][2]["local_experts"] == 2
    assert first["auto ep2×dp2 (mp=1)"][2]["local_experts"] == 2


# ---------------------------------------------------------------- config (no spawn)
def test_the_config_accepts_the_expert_combinations():
    assert ParallelConfig(pipeline_degree=2, expert_degree=2).resolve(4).data_degree == 1
    config = ParallelConfig(expert_degree=2, enable_parallel_optimizer=True)
    assert config.resolve(2).batch_ranks == 2
    semi = ParallelConfig(strategy_tags=True, tensor_degree=2, expert_degree=2).resolve(8)
    assert (semi.data_degree, semi.stage_ranks, semi.batch_ranks) == (2, 8, 4)
    ParallelConfig(pipeline_degree=2, expert_degree=2, enable_parallel_optimizer=True).resolve(4)
    auto = ParallelConfig(search_mode="sharding_propagation", tensor_degree=2,
                          expert_degree=2).resolve(8)
    assert (auto.data_degree, auto.batch_ranks) == (2, 4)
    assert auto_limits(auto, moe=True)["data"] == 4  # the plan keeps the MoE rows' batch split


@pytest.mark.parametrize("fields, message", [
    (dict(strategy_tags=True, expert_degree=2, pipeline_degree=2),
     "expert × pipeline × tensor is unsupported"),
    (dict(strategy_tags=True, expert_degree=2, enable_parallel_optimizer=True),
     "expert × optimizer × tensor is unsupported"),
    (dict(expert_degree=2, enable_parallel_optimizer=True, optimizer_weight_shard_size=2),
     "with optimizer_weight_shard_size is not built yet"),
    (dict(search_mode="sharding_propagation", expert_degree=2, pipeline_degree=2),
     "auto × expert × pipeline is unsupported"),
])
def test_unbuilt_or_meaningless_expert_combinations_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**fields)


def test_a_semi_auto_strategy_inside_an_moe_layer_is_refused_and_nothing_changes():
    parallel.init()
    model = moe_gpt(2, 2)
    strategies = {**load_strategy_file(STRATEGY, dp=1, mp=1), "blocks.1.mlp.router.gate":
                  [[1, 1, 1], [1, 1]]}
    with pytest.raises(ValueError, match="'blocks.1.mlp.router.gate', part of the MoE layer"):
        parallel.parallelize(model, ParallelConfig(strategies=strategies))
    assert isinstance(model.blocks[1].mlp, MoE)
    assert not any(isinstance(p, DTensor) for p in model.parameters())


def test_an_moe_model_under_semi_auto_in_one_process_computes_as_the_plain_model():
    parallel.init()
    plain = moe_gpt(2, 2)
    model = parallel.parallelize(moe_gpt(2, 2), ParallelConfig(
        strategies=load_strategy_file(STRATEGY, dp=1, mp=1))).model
    x, y = batch(0)
    _, want = plain(x, y)
    _, got = model(x, y)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_an_moe_model_is_split_into_stages_by_flops_on_fake_tensors():
    """The automatic split (and the stages' dry run) measures MoE layers on fake tensors, where
    routing cannot run: they propagate shapes and top_k experts' worth of work."""
    plan = make_plan(moe_gpt(4, 2), ParallelConfig(pipeline_degree=2, micro_batches=2),
                     example_inputs=batch(0)[:1])
    assert [plan.stage_of[f"blocks.{i}"] for i in range(4)] == [0, 0, 1, 1]
