"""Optimizer parallel (``ShardedDataParallel``, levels 1/2/3) on 2 and 4 gloo ranks against
unsharded DataParallel and one process on the concatenated batch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

import parallel
from distributed import run_ranks
from parallel import ParallelConfig
from parallel.data.replicas import DataParallel
from parallel.optimizer_parallel import ShardedDataParallel
from recipes.gpt import GPT
from torch_features import needs_spmd_sharding

LOCAL, MICRO, STEPS = 4, 2, 20
LEVELS = ("level1", "level2", "level3")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 1))


def _batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(LOCAL * world, 8, generator=g), torch.randn(LOCAL * world, 1, generator=g)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: _full(p.detach()).clone() for n, p in model.named_parameters()}


def _train(model: nn.Module, steps: range, rank: int, world: int, clip: float | None = None
           ) -> list[float]:
    """AdamW steps of MICRO accumulated micro-batches each; rank's slice of the global batch
    (world=1: the whole batch). Returns the clipped-away norms."""
    opt = getattr(model, "_test_opt", None) or torch.optim.AdamW(model.parameters(), lr=1e-2)
    model._test_opt = opt
    norms = []
    for step in steps:
        for m in range(MICRO):
            x, y = _batch(step * MICRO + m, world)
            x, y = x.chunk(world // model._test_world)[rank], y.chunk(
                world // model._test_world)[rank]
            loss = F.mse_loss(model(x), y) / MICRO
            if m < MICRO - 1 and hasattr(model, "no_sync"):
                with model.no_sync():
                    loss.backward()
            else:
                loss.backward()
        if clip is not None:
            clipper = getattr(model, "clip_grad_norm_", None)
            norms.append(float(clipper(clip) if clipper else
                               nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return norms


def _reference(world: int, clip: float | None) -> tuple[dict, list[float]]:
    model = _net()
    model._test_world = world  # one process on the concatenated batch
    norms = _train(model, range(STEPS), 0, world, clip)
    return _params(model), norms


def _levels(rank: int, world: int, shard_size: int | None, threshold: int) -> dict:
    parallel.init()
    out = {}
    for level in ("none", *LEVELS):
        torch.manual_seed(rank)  # different on every rank: the broadcast must fix it
        if level == "none":
            model = DataParallel(_net())
        else:
            config = ParallelConfig(enable_parallel_optimizer=True, optimizer_level=level,
                                    optimizer_weight_shard_size=shard_size,
                                    parallel_optimizer_threshold=threshold)
            model = parallel.parallelize(_net(), config).model
        model._test_world = 1
        norms = _train(model, range(STEPS), rank, world, clip=0.05)
        state = [t for s in model._test_opt.state.values() for t in s.values()
                 if t.dim() > 0]
        out[level] = {"params": _params(model), "norms": norms,
                      "state_bytes": sum(_local(t).nbytes for t in state),
                      "replicated": getattr(model, "replicated", None)}
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _close(a: dict, b: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("world,shard_size,threshold", [(2, None, 0), (4, None, 1), (4, 2, 0)])
def test_each_level_trains_like_data_parallel_and_one_process(world, shard_size, threshold):
    results = run_ranks(_levels, world, shard_size, threshold, timeout=300)
    ref_params, ref_norms = _reference(world, clip=0.05)
    total_state = 2 * 4 * sum(p.numel() for p in ref_params.values())  # exp_avg + exp_avg_sq
    for rank, result in enumerate(results):
        for level in LEVELS:
            got = result[level]
            _close(got["params"], result["none"]["params"])
            _close(got["params"], ref_params)
            torch.testing.assert_close(got["norms"], ref_norms, rtol=1e-5, atol=0)
            shards = shard_size or world
            replicated = sum(ref_params[n].numel() * 8 for n in got["replicated"])
            # optimizer state per rank: 1/shards of the sharded part (+ the replicated part)
            assert got["state_bytes"] == pytest.approx(
                (total_state - replicated) / shards + replicated, rel=0.05), (rank, level)
        assert result["none"]["state_bytes"] == total_state
    if threshold:  # 1 KB: the biases and the 64-wide head stay replicated
        assert results[0]["level2"]["replicated"] == ["0.bias", "2.bias", "4.weight", "4.bias"]


def _gpt(rank: int, world: int, level: str) -> dict:
    parallel.init()
    torch.manual_seed(0)
    model = parallel.parallelize(GPT(48, 32, 2, 2, 16, 0.0), ParallelConfig(
        enable_parallel_optimizer=True, optimizer_level=level,
        parallel_optimizer_threshold=0)).model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(6):
        idx = torch.randint(0, 48, (2 * world, 16), generator=torch.Generator().manual_seed(step))
        mine = idx.chunk(world)[rank]
        _, loss = model(mine, mine.roll(1, 1))
        loss.backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    assert model.tok_emb.weight is model.lm_head.weight  # the tie survives sharding
    return {"losses": torch.stack(losses), "params": _params(model)}


@pytest.mark.slow
@pytest.mark.parametrize("level", ["level1", "level3"])
def test_a_tied_gpt_trains_like_one_process(level):
    results = run_ranks(_gpt, 2, level, timeout=300)
    torch.manual_seed(0)
    reference = GPT(48, 32, 2, 2, 16, 0.0)
    opt = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    for step in range(6):
        idx = torch.randint(0, 48, (4, 16), generator=torch.Generator().manual_seed(step))
        losses = [reference(half, half.roll(1, 1))[1] for half in idx.chunk(2)]
        sum(losses).div(2).backward()
        nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    _close(results[0]["params"], _params(reference), rtol=1e-4, atol=1e-5)
    _close(results[1]["params"], results[0]["params"], rtol=0, atol=0)


_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _sharded(level: str) -> nn.Module:
    model = parallel.parallelize(_net(), ParallelConfig(
        enable_parallel_optimizer=True, optimizer_level=level,
        parallel_optimizer_threshold=0)).model
    model._test_world = 1
    model._test_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model


def _save(rank: int, world: int, path: str) -> dict:
    parallel.init()
    model = _sharded("level2")
    _train(model, range(3), rank, world)
    model_sd, optim_sd = get_state_dict(model, model._test_opt, options=_FLAT)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    # gathered to one torch.optim.AdamW state dict, which a plain model's AdamW continues from
    full_model, full_optim = copy.deepcopy(get_state_dict(  # as torch.save + load would
        model, model._test_opt, options=StateDictOptions(full_state_dict=True)))
    plain = _net()
    plain.load_state_dict(full_model)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    set_state_dict(plain, plain_opt, model_state_dict=full_model, optim_state_dict=full_optim)
    plain._test_world, plain._test_opt = world, plain_opt
    _train(model, range(3, 6), rank, world)
    _train(plain, range(3, 6), 0, world)  # one process on the whole batch
    return {"sharded": _params(model), "plain": _params(plain)}


def _resume(rank: int, world: int, path: str, saved_world: int) -> dict:
    parallel.init()
    model = _sharded("level3")  # a different level reads the same checkpoint
    model_sd, optim_sd = get_state_dict(model, model._test_opt, options=_FLAT)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, model._test_opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=_FLAT)
    # the same global batches as the saving run: each rank takes its slice of them
    x_world = saved_world
    for step in range(3, 6):
        for m in range(MICRO):
            x, y = _batch(step * MICRO + m, x_world)
            loss = F.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]) / MICRO
            loss.backward()
        model._test_opt.step()
        model._test_opt.zero_grad()
    return _params(model)


@pytest.mark.slow
def test_a_checkpoint_resumes_at_the_same_and_a_larger_data_degree(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_save, 2, path, timeout=300)[0]
    continued = saved["sharded"]
    _close(saved["plain"], continued)  # the gathered state is torch.optim.AdamW's
    for world in (2, 4):
        resumed = run_ranks(_resume, world, path, 2, timeout=300)
        _close(resumed[0], continued)


def test_bad_settings_are_refused_before_anything_changes():
    parallel.init()
    with pytest.raises(ValueError, match="data_degree=1: there is no replica"):
        ParallelConfig(enable_parallel_optimizer=True).resolve(1)
    with pytest.raises(ValueError, match="optimizer_weight_shard_size=3 must divide the "
                                         "data_degree 4"):
        ParallelConfig(enable_parallel_optimizer=True, optimizer_weight_shard_size=3).resolve(4)
    with pytest.raises(ValueError, match="optimizer_weight_shard_size must be at least 2"):
        ParallelConfig(enable_parallel_optimizer=True, optimizer_weight_shard_size=1)
    with pytest.raises(ValueError, match="optimizer_level 'level4' is not one of"):
        ParallelConfig(enable_parallel_optimizer=True, optimizer_level="level4")
    with pytest.raises(ValueError, match="data_degree=1: there is no replica"):
        ParallelConfig(data_degree=1, enable_parallel_optimizer=True).resolve(1)
    with pytest.raises(ValueError, match="param_dtype=torch.float32: a 16-bit dtype"):
        ParallelConfig(enable_parallel_optimizer=True, param_dtype=torch.float32)
    model = _net()
    before = _params(model)
    with pytest.raises(ValueError, match="group has 1 rank, so there is no replica"):
        ShardedDataParallel(model)
    with pytest.raises(ValueError, match="level 'level0' is not one of"):
        ShardedDataParallel(model, "level0")
    with pytest.raises(ValueError, match="already wrapped"):
        ShardedDataParallel(DataParallel(model))
    assert all(type(p) is nn.Parameter for p in model.parameters())
    _close(_params(model), before, rtol=0, atol=0)


def test_the_context_front_door_reads_the_parallel_optimizer_config():
    parallel.context.set_auto_parallel_context(
        parallel_mode="data_parallel", enable_parallel_optimizer=True,
        parallel_optimizer_config={"optimizer_level": "level3", "optimizer_weight_shard_size": 2})
    try:
        config = ParallelConfig.from_context().resolve(4)
        assert (config.optimizer_level, config.optimizer_shard_size) == ("level3", 2)
        with pytest.raises(ValueError, match="unknown keys \\['level'\\]"):
            parallel.context.set_auto_parallel_context(
                parallel_optimizer_config={"level": "level1"})
    finally:
        parallel.context.reset_auto_parallel_context()


def _bf16_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 63), nn.Tanh(),
                         nn.Linear(63, 1))


def _offload_steps(model: nn.Module, opt, steps: range, rank: int, world: int) -> list[float]:
    norms = []
    for step in steps:
        x, y = _batch(step, world)
        F.mse_loss(model(x.chunk(world)[rank].bfloat16()).float(), y.chunk(world)[rank]).backward()
        norms.append(float(opt.grad_norm()))  # global over the slices; clipping is fp32-tested
        opt.step()
        opt.zero_grad()
    return norms


def _offload(rank: int, world: int, level: str, path: str) -> dict:
    """DataParallel + OffloadAdamW(bf16) against ShardedDataParallel(bf16) + OffloadAdamW(bf16):
    each rank keeps only its slice of the FP32 masters and moments on the host."""
    from hetero.optim import OffloadAdamW

    parallel.init()
    out = {}

    def build(sharded: bool):
        model = (ShardedDataParallel(_bf16_net(), level, threshold_kb=1,
                                     param_dtype=torch.bfloat16) if sharded
                 else DataParallel(_bf16_net()))
        return model, OffloadAdamW(model.parameters(), lr=1e-2, param_dtype=torch.bfloat16,
                                   overlap_backward=False)

    for sharded in (False, True):
        model, opt = build(sharded)
        norms = _offload_steps(model, opt, range(STEPS // 2), rank, world)
        if sharded:  # a DCP checkpoint of the sharded host state, resumed below
            model_sd, optim_sd = get_state_dict(model, opt, options=_FLAT)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        norms += _offload_steps(model, opt, range(STEPS // 2, STEPS), rank, world)
        out[sharded] = {"params": _params(model), "norms": norms,
                        "host_bytes": opt.memory_stats()["host_bytes"],
                        "masters": [type(s["fp32_master"]).__name__
                                    for s in opt.state_dict()["state"].values()
                                    if "fp32_master" in s]}
    model, opt = build(True)
    model_sd, optim_sd = get_state_dict(model, opt, options=_FLAT)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=_FLAT)
    _offload_steps(model, opt, range(STEPS // 2, STEPS), rank, world)
    out["resumed"] = _params(model)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
def test_offload_adamw_keeps_only_its_slice_on_the_host_and_trains_the_same(level, tmp_path):
    results = run_ranks(_offload, 2, level, str(tmp_path / "ckpt"), timeout=300)
    for result in results:
        plain, sharded = result[False], result[True]
        _close(sharded["params"], plain["params"], rtol=0, atol=0)  # bf16, same reductions
        torch.testing.assert_close(sharded["norms"], plain["norms"], rtol=1e-5, atol=0)
        _close(result["resumed"], sharded["params"], rtol=0, atol=0)
        # 5 sharded tensors hold 8·64 + 64·64 + 64·63 + 63 + 63·... elements: about half each
        assert sharded["host_bytes"] < 0.56 * plain["host_bytes"]
        assert set(sharded["masters"]) == {"DTensor", "Tensor"}  # sharded and replicated


def _pipelined(rank: int, world: int) -> dict:
    from parallel.semi_auto import load_strategy_file
    from pipeline_helpers import train_pipelined

    out = {(level, schedule): train_pipelined(ParallelConfig(
        pipeline_degree=2, micro_batches=2, schedule=schedule, enable_parallel_optimizer=True,
        optimizer_level=level, parallel_optimizer_threshold=1), 5)
        for level, schedule in (("level1", "gpipe"), ("level2", "1f1b"), ("level3", "1f1b"))}
    # semi-auto's dataset strategy per stage (each dp rank feeds its slice), sharded along dp
    out["semi_auto"] = train_pipelined(ParallelConfig(
        pipeline_degree=2, tensor_degree=1, data_degree=2, full_batch=False,
        micro_batches=2, enable_parallel_optimizer=True, parallel_optimizer_threshold=0,
        strategies=load_strategy_file("conf/strategy/gpt_megatron.yaml", dp=2, mp=1)), 5)
    out["norms"] = [_pipelined_grad_norm(config) for config in (
        ParallelConfig(pipeline_degree=2, micro_batches=2, enable_parallel_optimizer=True,
                       parallel_optimizer_threshold=1),
        ParallelConfig(pipeline_degree=2, tensor_degree=1, data_degree=2,
                       full_batch=False,
                       micro_batches=2, enable_parallel_optimizer=True,
                       parallel_optimizer_threshold=0,
                       strategies=load_strategy_file("conf/strategy/gpt_megatron.yaml", dp=2,
                                                     mp=1)))]
    return out


def _pipelined_grad_norm(config: ParallelConfig) -> float:
    """The whole model's gradient norm after one step: AdamW would hide a gradient scaled by
    the replica count, the norm does not."""
    from pipeline_helpers import BATCH, batch, gpt_loss, tiny_gpt

    pipe = parallel.parallelize(tiny_gpt(), config, loss_fn=gpt_loss).model
    mesh = parallel.mesh.parallel_mesh(config.resolve(parallel.get_world_size()))
    per = BATCH // 2
    start = mesh["dp"].get_local_rank() * per
    x, y = batch(0)
    pipe.step(x[start:start + per], target=y[start:start + per])
    return float(pipe.clip_grad_norm_(1e9))


@needs_spmd_sharding
@pytest.mark.slow
def test_each_pipeline_stage_shards_its_optimizer_over_its_replicas():
    from pipeline_helpers import batch, gpt_loss, reference, tiny_gpt

    want_losses, want = reference(5)
    model = tiny_gpt()
    x, y = batch(0)
    gpt_loss(model(x), y).backward()
    want_norm = float(nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    for result in run_ranks(_pipelined, 4, timeout=600):
        assert result.pop("norms") == pytest.approx([want_norm] * 2, rel=1e-5)
        for (losses, params, _) in result.values():
            assert losses == pytest.approx(want_losses, rel=1e-5)
            # atol: the attention key bias, whose true gradient is 0 (test_pipeline._assert_matches)
            _close(params, {n: want[n] for n in params}, atol=5e-5)


def _gpt_steps(model: nn.Module, opt, clip: float | None) -> tuple[dict, list[float]]:
    from pipeline_helpers import batch, gpt_loss

    norms = []
    for step in range(5):
        x, y = batch(step)
        loss = gpt_loss(model(x), y)
        loss.backward()
        if clip is not None:
            clipper = getattr(model, "clip_grad_norm_", None)
            norms.append(float(clipper(clip) if clipper
                               else nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return _params(model), norms


def _semi_auto(rank: int, world: int, level: str) -> dict:
    """A (dp=2, mp=2) semi-auto GPT whose optimizer is also sharded along dp: SGD (any
    gradient-scale error shows) and AdamW with clipping."""
    from parallel.semi_auto import load_strategy_file
    from pipeline_helpers import tiny_gpt

    parallel.init()
    out = {}
    for name in ("sgd", "adamw"):
        config = ParallelConfig(
            data_degree=2, tensor_degree=2,
            enable_parallel_optimizer=True,
            optimizer_level=level, parallel_optimizer_threshold=0,
            strategies=load_strategy_file("conf/strategy/gpt_megatron.yaml", dp=2, mp=2))
        model = parallel.parallelize(tiny_gpt(), config).model
        opt = (torch.optim.SGD(model.parameters(), lr=0.5) if name == "sgd"
               else torch.optim.AdamW(model.parameters(), lr=1e-2))
        out[name] = _gpt_steps(model, opt, None if name == "sgd" else 0.5)
        placements = {n: tuple(p.placements) for n, p in model.named_parameters()}
        state = [t for s in opt.state.values() for t in s.values() if t.dim() > 0]
        out[name + "_state"] = sum(_local(t).numel() for t in state)
    out["placements"] = placements
    return out


@needs_spmd_sharding
@pytest.mark.slow
@pytest.mark.parametrize("level", ["level1", "level3"])
def test_semi_auto_parameters_shard_their_optimizer_along_dp(level):
    from pipeline_helpers import tiny_gpt

    results = run_ranks(_semi_auto, 4, level, timeout=600)
    want = {}
    for name in ("sgd", "adamw"):
        model = tiny_gpt()
        opt = (torch.optim.SGD(model.parameters(), lr=0.5) if name == "sgd"
               else torch.optim.AdamW(model.parameters(), lr=1e-2))
        want[name] = _gpt_steps(model, opt, None if name == "sgd" else 0.5)
    total_state = 2 * sum(p.numel() for p in tiny_gpt().parameters())
    for result in results:
        for name in ("sgd", "adamw"):
            params, norms = result[name]
            _close(params, want[name][0], atol=5e-5)  # see test_pipeline._assert_matches
            torch.testing.assert_close(norms, want[name][1], rtol=1e-5, atol=0)
        # a weight is sharded 2-D: its rows along dp (strided: mp split them first), and as
        # semi-auto put it along mp
        placements = result["placements"]
        assert not placements["blocks.0.mlp.0.weight"][0].is_replicate()
        assert placements["blocks.0.mlp.0.weight"][1].is_shard()
        assert placements["blocks.0.ln1.weight"][1].is_replicate()
        # state per rank: 1/2 along dp of what semi-auto already split along mp
        assert result["adamw_state"] < 0.5 * total_state


def _summed(rank: int, world: int) -> dict:
    parallel.init()
    out = {}
    for sharded in (False, True):
        torch.manual_seed(0)
        model = (ShardedDataParallel(_net(), "level2", threshold_kb=1,
                                     gradients_mean=False) if sharded
                 else DataParallel(_net(), gradients_mean=False))
        model._test_world = 1
        model._test_opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        _train(model, range(3), rank, world)
        out[sharded] = _params(model)
    return out


@pytest.mark.slow
def test_summed_gradients_match_data_parallel_with_sgd():
    """gradients_mean=False sums over the replicas (forced SUM: gloo has no PREMUL_SUM); SGD,
    unlike Adam, shows any scale error."""
    for result in run_ranks(_summed, 2, timeout=300):
        _close(result[True], result[False])


def _unshardable(rank: int, world: int) -> dict:
    parallel.init()
    model = ShardedDataParallel(_net(), "level2", threshold_kb=1)
    errors = {}
    for make in (lambda ps: torch.optim.LBFGS(ps), lambda ps: torch.optim.SparseAdam(ps)):
        before = _params(model)
        opt = make(list(model.parameters()))
        F.mse_loss(model(torch.randn(4, 8)), torch.zeros(4, 1)).backward()
        try:
            opt.step(lambda: F.mse_loss(model(torch.randn(4, 8)), torch.zeros(4, 1)))
        except TypeError as err:
            errors[type(opt).__name__] = str(err)
        _close(_params(model), before, rtol=0, atol=0)  # refused before any update
        model.zero_grad()
    return errors


@pytest.mark.slow
def test_an_optimizer_that_cannot_update_slices_is_refused_by_name():
    for errors in run_ranks(_unshardable, 2, timeout=120):
        assert "LBFGS cannot update parameters sharded by optimizer parallel" in errors["LBFGS"]
        assert "needs row-sparse gradients" in errors["SparseAdam"]


def _sharded_on_batch(rank: int, world: int) -> str:
    parallel.init()
    model = _net()
    config = ParallelConfig(data_degree=2, tensor_degree=1,
                            enable_parallel_optimizer=True,
                            strategies={"0": ((1, 1), (2, 1))})  # weight rows over the dp ranks
    try:
        parallel.parallelize(model, config)
    except ValueError as err:
        assert all(type(p) is nn.Parameter for p in model.parameters())  # nothing changed
        return str(err)
    return "not refused"


@pytest.mark.slow
def test_a_strategy_splitting_a_weight_over_the_batch_axis_is_refused_before_sharding():
    for message in run_ranks(_sharded_on_batch, 2, timeout=120):
        assert "semi-auto parameter '0.weight' is S(0) along data-parallel mesh dim 0 by the " \
               "strategy of 0" in message and "must replicate it on the batch axis" in message
