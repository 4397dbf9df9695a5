"""Two combinations that were refused as not built, each equal to one process on the global batch
(rel 1e-5), from one spawn of 4 gloo ranks:

* ``auto_parallel`` with ``full_batch=False``: the planner keeps a data axis of 2 ranks and each
  feeds its own half of the batch (the tiny GPT, the dynamic-programming search), also per
  pipeline stage (2 stages of 2 data ranks);
* ``hybrid_parallel``: a Megatron MLP with its own collectives over ``mp`` (dp 2 x mp 2); the
  framework broadcasts parameters at wrap (slices over ``dp`` only) and averages gradients over
  ``dp`` only.

The config's acceptance and refusals are checked without spawning.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import hetero
import parallel
from distributed import run_ranks
from hybrid_models import MLP, MegatronMLP
from hybrid_models import batch as mlp_batch
from hybrid_models import reference as mlp_reference
from parallel import ParallelConfig
from parallel.auto.apply import auto_limits
from parallel.mesh import batch_mesh
from pipeline_helpers import BATCH, batch, full_params, reference, tiny_gpt, train_pipelined
from recipe_helpers import compose_train
from recipes.parallel_mode import parallel_config

STEPS = 3


def _auto_slices(world: int) -> dict[str, Any]:
    config = ParallelConfig(tensor_degree=2, full_batch=False,
                            search_mode="dynamic_programming")
    result = parallel.parallelize(tiny_gpt(), config, example_inputs=(batch(0)[0],))
    model = result.model
    resolved = config.resolve(world)
    per = BATCH // resolved.data_degree
    start = batch_mesh(resolved).get_local_rank() * per
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        # this rank's slice in, the global batch's mean loss out
        _, loss = model(x[start:start + per], y[start:start + per])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": full_params(model),
            "batch_split": [op.strategy[0][0] for op in
                            result.plan.ops]}


def _megatron(config: ParallelConfig, world: int, perturb: bool) -> MegatronMLP:
    """The MLP's slices for this rank; with ``perturb``, every tensor parameter_broadcast
    must overwrite differs from rank 0's (replicated ones off rank 0, slices off data rank 0)."""
    resolved = config.resolve(world)
    mesh = parallel.mesh.parallel_mesh(resolved)
    mp = mesh["tp"]
    model = MegatronMLP(MLP(), mp.get_group(), mp.get_local_rank(), resolved.tensor_degree)
    dp_rank, mp_rank = mesh["dp"].get_local_rank(), mp.get_local_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            sliced = name.startswith(("fc1_", "fc2_weight"))
            if perturb and (dp_rank > 0 or (mp_rank > 0 and not sliced)):
                p.add_(0.01 * (1 + parallel.get_rank()))
    return model


def _hybrid(world: int, optimizer_level: str | None = None) -> dict[str, Any]:
    config = ParallelConfig(tensor_degree=2,
                            enable_parallel_optimizer=optimizer_level is not None,
                            optimizer_level=optimizer_level or "level1",
                            parallel_optimizer_threshold=0)
    megatron = _megatron(config, world, perturb=True)
    model = parallel.parallelize(megatron, config).model
    resolved = config.resolve(world)
    per = BATCH // resolved.data_degree
    start = batch_mesh(resolved).get_local_rank() * per
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        x, y = mlp_batch(step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x[start:start + per]), y[start:start + per])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    out = {"losses": losses, "params": megatron.full_state(), "wrapper": type(model).__name__}
    if optimizer_level is not None:  # the optimizer state is this rank's dp shard
        out["sharded"] = sorted(n for n, p in megatron.named_parameters()
                                if isinstance(p, DTensor))
        return out
    errors = {}
    try:  # nothing marked: broadcasting over mp would overwrite the slices
        parallel.parallelize(MLP(), config)
    except ValueError as err:
        errors["unmarked"] = str(err)
    try:  # without broadcast, replicated tensors must already agree over mp
        unequal = _megatron(config, world, perturb=False)
        with torch.no_grad():
            if parallel.mesh.parallel_mesh(resolved)["tp"].get_local_rank() == 1:
                unequal.ln.weight.add_(1.0)
        parallel.parallelize(unequal, ParallelConfig(tensor_degree=2,
                                                     parameter_broadcast=False))
    except ValueError as err:
        errors["unequal"] = str(err)
    out["errors"] = errors
    return out


def _four_ranks(rank: int, world: int) -> dict[str, Any]:
    parallel.init()
    staged = train_pipelined(ParallelConfig(
        pipeline_degree=2, data_degree=2, full_batch=False, micro_batches=2,
        search_mode="dynamic_programming"), STEPS, example=True)
    return {"auto_slices": _auto_slices(world), "auto_slices_staged": staged[:2],
            "hybrid": _hybrid(world), "hybrid_sharded": _hybrid(world, "level2")}


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return run_ranks(_four_ranks, 4, timeout=300)


@pytest.mark.slow
def test_auto_parallel_feeds_each_data_rank_its_slice_like_one_process(four_ranks):
    want_losses, want = reference(STEPS)
    for result in four_ranks:
        got = result["auto_slices"]
        assert got["losses"] == pytest.approx(want_losses, rel=1e-5)
        # the attention key bias has a zero true gradient: AdamW turns rounding into ~1e-5 moves
        for name, value in got["params"].items():
            torch.testing.assert_close(value, want[name], rtol=1e-5, atol=2e-5,
                                       msg=lambda m, name=name: f"{name}: {m}")
        assert all(split % 2 == 0 for split in got["batch_split"])  # the data axis is kept


@pytest.mark.slow
def test_auto_parallel_pipeline_stages_feed_their_data_ranks_slices(four_ranks):
    want_losses, want = reference(STEPS)
    for result in four_ranks:
        losses, params = result["auto_slices_staged"]
        assert losses == pytest.approx(want_losses, rel=1e-5)
        for name, value in params.items():
            torch.testing.assert_close(value, want[name], rtol=1e-5, atol=2e-5,
                                       msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.slow
def test_hybrid_with_a_sharded_optimizer_trains_like_one_process(four_ranks):
    """hybrid × optimizer: the model's own mp collectives, its optimizer (and, at level2,
    gradients) sharded over dp by FSDP2."""
    want_losses, want = mlp_reference(STEPS)
    sharded = [r["hybrid_sharded"] for r in four_ranks]
    assert sharded[0]["wrapper"] == "ShardedDataParallel"
    assert "fc1_weight" in sharded[0]["sharded"] and "ln.weight" in sharded[0]["sharded"]
    global_losses = [(a + b) / 2 for a, b in zip(sharded[0]["losses"], sharded[2]["losses"],
                                                strict=True)]
    assert global_losses == pytest.approx(want_losses, rel=1e-5)
    for result in sharded:
        for name, value in result["params"].items():
            torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.slow
def test_hybrid_megatron_mlp_trains_like_one_process(four_ranks):
    want_losses, want = mlp_reference(STEPS)
    hybrid = [r["hybrid"] for r in four_ranks]  # ranks (dp, mp): 0 (0,0) 1 (0,1) 2 (1,0) 3 (1,1)
    assert hybrid[0]["wrapper"] == "DataParallel"
    assert hybrid[0]["losses"] == hybrid[1]["losses"]  # one replica's mp ranks: one loss
    # each replica's loss is its half's mean: the global mean is their mean
    global_losses = [(a + b) / 2 for a, b in zip(hybrid[0]["losses"], hybrid[2]["losses"],
                                                strict=True)]
    assert global_losses == pytest.approx(want_losses, rel=1e-5)
    for result in hybrid:
        for name, value in result["params"].items():
            torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")
        assert "no parameter of MLP is marked with parallel.mark_model_parallel" in \
            result["errors"]["unmarked"]
        assert result["errors"]["unequal"].startswith(
            "hybrid_parallel(parameter_broadcast=False) over 'mp': 'ln.weight' on rank 1 "
            "differs from rank 0's")


# ------------------------------------------------------------------ the config, no spawn
def test_the_config_accepts_both_combinations():
    auto = ParallelConfig(search_mode="sharding_propagation", tensor_degree=2,
                          full_batch=False).resolve(8)
    assert (auto.data_degree, auto.tensor_degree, auto.full_batch) == (4, 2, False)
    assert auto_limits(auto) == {"max_device_memory": None, "data": 4}
    hybrid = ParallelConfig(tensor_degree=2).resolve(4)
    assert (hybrid.data_degree, hybrid.tensor_degree) == (2, 2)
    staged = ParallelConfig(tensor_degree=2, pipeline_degree=2,
                            micro_batches=2).resolve(8)  # tests/test_hybrid_pipeline.py trains it
    assert (staged.pipeline_degree, staged.data_degree, staged.tensor_degree) == (2, 2, 2)
    experts = ParallelConfig(tensor_degree=2, expert_degree=2).resolve(8)
    assert (experts.data_degree, experts.expert_degree, experts.batch_ranks) == (2, 2, 4)
    # the recipe: parallel=auto parallel.full_batch=false keeps it (model_parallel: null is 1)
    cfg = compose_train(["parallel=auto", "parallel.strategy=null", "parallel.full_batch=false",
                         "parallel.search_mode=dynamic_programming"])
    config = parallel_config(cfg.parallel, 4)
    assert (config.data_degree, config.tensor_degree, config.full_batch) == (4, 1, False)


@pytest.mark.parametrize("kwargs, match", [
    (dict(search_mode="sharding_propagation", tensor_degree=2),
     "leave tensor_degree=1 \\(with enable_parallel_optimizer, full_batch=False or "
     "expert_degree > 1"),
    (dict(full_batch=False, strategy_tags=False), "full_batch=False is the dataset strategy of "
                                                  "a split by strategies"),
    (dict(tensor_degree=2, full_batch=False, strategy_tags=False),
     "per_rank_batch is meaningless"),
])
def test_meaningless_combinations_are_still_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kwargs)


def test_hybrid_places_tagged_modules_by_whole_modules_and_checks_its_marks():
    parallel.init()
    try:
        model = MLP()
        hetero.set_device(model.head, "cpu")  # placed with hooks: tests/test_hybrid_combinations
        # tensor_degree=2 with no strategies: the model's own collectives (trained on 2 ranks
        # there); placement alone needs no second rank
        placed = parallel.compose.apply_placement(model, ParallelConfig(tensor_degree=2))
        assert type(placed).__name__ == "HookPlacedModule" and placed.plan.mode == "hooks"
        with pytest.raises(TypeError, match="takes modules, parameters or buffers, got int"):
            parallel.mark_model_parallel(3)
        plain = MLP()  # one rank, model=1: nothing to broadcast or reduce
        assert parallel.parallelize(plain, ParallelConfig()).model is plain
    finally:
        parallel.destroy()
