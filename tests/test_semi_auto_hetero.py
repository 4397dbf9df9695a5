"""Host offload and host placement together with semi-auto (and auto) parallel, on 4 gloo ranks
against one process on the same global batch.

* ``hetero.optim.OffloadAdamW`` over a semi-auto GPT (dp=2 × mp=2, each dp rank feeding its
  slice): FP32 trains as ``torch.optim.AdamW`` in one process; with bf16 device copies each rank
  keeps FP32 masters and moments of its local shards only, every step is torch's AdamW on the
  FP32 masters with the gathered gradients, and the gradient hooks (after semi-auto's reduction)
  give the same result as taking gradients at ``step()``; ``state_dict`` goes to
  ``torch.optim.AdamW`` and back.
* ``hetero.set_device(module, "cpu")`` on modules of that GPT: the token embedding (tied to the
  output head, which stays on the device) replicated on the host, and one block's MLP tensor
  parallel on the host; trains as one process, with ``OffloadAdamW`` and clipping too, and under
  auto_parallel; and in the GPT recipe (``parallel=semi_auto offload=optimizer
  hetero.cpu_modules=[tok_emb]``).

One spawn runs every case but the recipe's (``_all_cases``); the tests read its results.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

import hetero
import parallel
from distributed import run_ranks
from foundation.compat import pytree
from hetero.local_parts import DTENSOR_COMPUTE_ATTR
from hetero.optim import OffloadAdamW
from parallel import ParallelConfig
from parallel.combinations import check_placement
from parallel.grad_clip import clip_grad_norm_
from parallel.semi_auto import load_strategy_file
from pipeline_helpers import BATCH, batch, full_params, tiny_gpt
from recipe_helpers import losses_of, run_recipe

WORLD, DP, MP = 4, 2, 2
STEPS, LR, CLIP = 4, 1e-2, 0.5
#: see test_pipeline._assert_matches: the attention key bias's true gradient is zero
ATOL = 2e-5
#: torch's fused kernel: "auto" would compile ours with Inductor in every rank (test_offload_adam
#: checks the kernels against each other)
KERNEL = "torch"


def _config(mode: str = "semi_auto_parallel") -> ParallelConfig:
    if mode == "auto_parallel":  # every rank feeds the whole batch; the planner splits
        return ParallelConfig(mode=mode, strategies=load_strategy_file(
            "conf/strategy/gpt_mlp_columns.yaml", dp=1, mp=WORLD))
    return ParallelConfig(mode=mode, data=DP, model=MP, full_batch=False,
                          strategies=load_strategy_file("conf/strategy/gpt_megatron.yaml",
                                                        dp=DP, mp=MP))


def _tagged() -> nn.Module:
    model = tiny_gpt()
    hetero.set_device(model.tok_emb, "cpu")         # replicated; lm_head shares its weight
    hetero.set_device(model.blocks[1].mlp, "cpu")   # carries megatron strategies: host TP
    return model


def _feed(rank: int, config: ParallelConfig) -> slice:
    if config.full_batch:
        return slice(0, BATCH)
    per = BATCH // DP
    start = (rank // MP) * per  # dp is the outer mesh dimension
    return slice(start, start + per)


def _step(model: nn.Module, opt, step: int, part: slice, clip: Callable | None = None,
          before_step: Callable | None = None) -> float:
    x, y = batch(step)
    _, loss = model(x[part], y[part])
    loss.backward()
    if clip is not None:
        clip()
    if before_step is not None:
        before_step()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _masters(model: nn.Module, opt: OffloadAdamW) -> dict[str, torch.Tensor]:
    return {n: opt.state[p]["fp32_master"].full_tensor() for n, p in model.named_parameters()}


def _offload_fp32(rank: int, out: dict) -> None:
    config = _config()
    model = parallel.parallelize(tiny_gpt(), config).model
    opt = OffloadAdamW(model.parameters(), lr=LR)
    losses = [_step(model, opt, s, _feed(rank, config)) for s in range(STEPS)]
    out["fp32"] = (losses, full_params(model))
    # ours -> torch: a twin semi-auto model with torch's AdamW continues where we stopped
    twin = parallel.parallelize(tiny_gpt(), config).model
    twin.load_state_dict(model.state_dict())
    theirs = torch.optim.AdamW(twin.parameters(), lr=LR)
    # a copy, as saved (torch would share our buffers); not copy.deepcopy: torch cannot copy or
    # pickle a DTensor whose shard starts inside a larger buffer, as ours do (DCP saves them)
    theirs.load_state_dict(pytree.tree_map_only(torch.Tensor, torch.clone, opt.state_dict()))
    for s in range(STEPS, STEPS + 2):
        _step(model, opt, s, _feed(rank, config))
        _step(twin, theirs, s, _feed(rank, config))
    out["resumed"] = (full_params(model), full_params(twin))
    # torch -> ours with bf16 device copies: moments and steps carried over exactly
    ours16 = OffloadAdamW(parallel.parallelize(tiny_gpt(), config).model.parameters(), lr=LR,
                          param_dtype=torch.bfloat16, kernel=KERNEL)
    ours16.load_state_dict(theirs.state_dict())
    out["loaded"] = all(
        torch.equal(s["exp_avg"].to_local(), t["exp_avg"].to_local()) and s["step"] == t["step"]
        for s, t in zip(ours16.state_dict()["state"].values(),
                        theirs.state_dict()["state"].values(), strict=True))


def _bf16_run(rank: int, overlap: bool) -> dict:
    """bf16 device copies; without ``overlap`` the gradients are still in ``.grad`` at
    ``step()``, and torch's AdamW on whole FP32 parameters takes the same ones each step."""
    config = _config()
    model = parallel.parallelize(tiny_gpt(), config).model
    ref = {n: nn.Parameter(p.full_tensor().detach().clone())  # the FP32 start, whole
           for n, p in model.named_parameters()}
    ref_opt = torch.optim.AdamW(ref.values(), lr=LR)
    opt = OffloadAdamW(model.parameters(), lr=LR, param_dtype=torch.bfloat16,
                       overlap_backward=overlap, kernel=KERNEL)
    held, errors, losses = [], [], []

    def check() -> None:
        held.append(any(p.grad is not None for p in model.parameters()))
        if not overlap:
            for n, p in model.named_parameters():
                ref[n].grad = p.grad.full_tensor().float()
    for s in range(STEPS):
        losses.append(_step(model, opt, s, _feed(rank, config), before_step=check))
        if not overlap:
            ref_opt.step()
            errors.append(max(float(((m - ref[n]).abs() - 1e-6 * ref[n].abs()).max())
                              for n, m in _masters(model, opt).items()))
    return {"losses": losses, "masters": _masters(model, opt), "held": held, "errors": errors,
            "dtypes": {p.dtype for p in model.parameters()},
            "all_dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
            "stats": opt.memory_stats(),
            "local": sum(p.to_local().numel() for p in model.parameters())}


def _placed(rank: int, out: dict) -> None:
    config = _config()
    model = parallel.parallelize(_tagged(), config).model
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = [_step(model, opt, s, _feed(rank, config),  # clipped over both meshes
                    clip=lambda: clip_grad_norm_(model.parameters(), CLIP))
              for s in range(STEPS)]
    out["placed"] = {"losses": losses, "params": full_params(model),
                     "host": {n for n, p in model.named_parameters()
                              if p.device_mesh.mesh_dim_names[0].endswith("@host")},
                     "explain": parallel.semi_auto.explain_sharding(model)}
    # with OffloadAdamW clipping its host gradients
    model = parallel.parallelize(_tagged(), config).model
    opt = OffloadAdamW(model.parameters(), lr=LR)
    out["placed_offload"] = ([_step(model, opt, s, _feed(rank, config),
                                    clip=lambda: opt.clip_grad_norm_(CLIP))
                              for s in range(STEPS)], full_params(model))
    config = _config("auto_parallel")
    model = parallel.parallelize(_tagged(), config, example_inputs=(batch(0)[0],)).model
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out["auto"] = ([_step(model, opt, s, _feed(rank, config)) for s in range(STEPS)],
                   full_params(model))


def _all_cases(rank: int, world: int) -> dict:
    parallel.init()
    out: dict = {}
    _offload_fp32(rank, out)
    for overlap in (True, False):
        out[("bf16", overlap)] = _bf16_run(rank, overlap)
    _placed(rank, out)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_all_cases, WORLD, timeout=400)


def _reference(steps: int, clip: float | None = None) -> tuple[list[float], dict]:
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for s in range(steps):
        x, y = batch(s)
        _, loss = model(x, y)
        loss.backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, full_params(model)


def _assert_trains_alike(losses: list[float], params: dict, want: tuple[list[float], dict]
                         ) -> None:
    assert losses == pytest.approx(want[0], rel=1e-5)
    assert params.keys() == want[1].keys()
    for name, value in params.items():
        torch.testing.assert_close(value, want[1][name], rtol=1e-5, atol=ATOL,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.slow
def test_offload_adamw_over_semi_auto_trains_like_torch_adamw_in_one_process(results):
    want = _reference(STEPS)
    for result in results:
        _assert_trains_alike(*result["fp32"], want)


@pytest.mark.slow
def test_offload_state_dict_goes_to_torch_adamw_on_the_sharded_model_and_back(results):
    for result in results:
        ours, theirs = result["resumed"]
        for name, value in ours.items():
            torch.testing.assert_close(value, theirs[name], rtol=1e-5, atol=ATOL, msg=name)
        assert result["loaded"]


@pytest.mark.slow
def test_bf16_copies_step_as_torch_adamw_on_the_local_fp32_masters(results):
    fp32_losses = _reference(STEPS)[0]
    for result in results:
        hooked, late = result[("bf16", True)], result[("bf16", False)]
        # each step is AdamW on the FP32 masters with the whole (gathered) gradient (rtol
        # 1e-6, and one float32 ulp at the parameters' scale: see test_offload_adam.ATOL)
        assert max(late["errors"]) <= 1e-7, late["errors"]
        # gradients taken by the hooks (after semi-auto's reduction) = taken at step()
        assert hooked["losses"] == late["losses"]
        for name, master in hooked["masters"].items():
            assert torch.equal(master, late["masters"][name]), name
        assert hooked["held"] == [False] * STEPS and late["held"] == [True] * STEPS
        assert hooked["dtypes"] == {torch.bfloat16} and hooked["all_dtensors"]
        assert hooked["losses"] == pytest.approx(fp32_losses, rel=1e-2)  # bf16 rounding
        # host state for the local shards only: mp splits the MLPs' weights in two
        stats = hooked["stats"]
        assert stats["num_params"] == hooked["local"]
        assert hooked["local"] < 0.75 * sum(p.numel() for p in tiny_gpt().parameters())


@pytest.mark.slow
def test_host_modules_in_a_semi_auto_model_train_like_one_process(results):
    want = _reference(STEPS, clip=CLIP)
    for result in results:
        placed = result["placed"]
        _assert_trains_alike(placed["losses"], placed["params"], want)
        assert placed["host"] == {"tok_emb.weight", "blocks.1.mlp.0.weight",
                                  "blocks.1.mlp.0.bias", "blocks.1.mlp.2.weight",
                                  "blocks.1.mlp.2.bias"}
        assert "on the host (hetero.set_device), same layouts on its twin mesh: tok_emb, " \
               "blocks.1.mlp" in placed["explain"]
        assert "blocks.1.mlp.0.weight        [64, 16] -> local [32, 16]" in placed["explain"]
        _assert_trains_alike(*result["placed_offload"], want)


@pytest.mark.slow
def test_host_modules_under_auto_parallel_train_like_one_process(results):
    want = _reference(STEPS)
    for result in results:
        _assert_trains_alike(*result["auto"], want)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_recipe_with_a_host_embedding_and_offload_under_semi_auto_matches_one_process(
        tmp_path, default_recipe_single):
    single, cache, _ = default_recipe_single
    both = tmp_path / "both"
    run_recipe(["trainer.max_steps=4", "parallel=semi_auto", "offload=optimizer",
                "offload.param_dtype=null", "hetero.cpu_modules=[tok_emb]"], 2, both, cache)
    got, want = losses_of(both), losses_of(single)
    assert [got[s] for s in range(1, 5)] == pytest.approx([want[s] for s in range(1, 5)],
                                                          rel=1e-5)
    log = (both / "train.log").read_text()
    assert "on the host (hetero.set_device), same layouts on its twin mesh: tok_emb" in log


# ---------------------------------------------------------------- fast: no spawned ranks


def test_config_accepts_placement_tags_with_semi_auto_and_refuses_what_is_not_built():
    parallel.init()  # one process
    model = _tagged()
    ref = tiny_gpt()
    x, y = batch(0)
    config = ParallelConfig(strategies=load_strategy_file(
        "conf/strategy/gpt_megatron.yaml", dp=1, mp=1))
    sharded = parallel.parallelize(model, config).model
    assert sharded.tok_emb.weight.device_mesh.mesh_dim_names == ("sa0@host",)
    assert sharded.pos_emb.weight.device_mesh.mesh_dim_names == ("sa0",)
    torch.testing.assert_close(sharded(x, y)[1], ref(x, y)[1], rtol=1e-6, atol=0)
    for bad, match in [
        (ParallelConfig(strategy_tags=True, pipeline_degree=2, micro_batches=2),
         "placement tags × tensor × pipeline is unsupported"),
        (ParallelConfig(search_mode="sharding_propagation", pipeline_degree=2, micro_batches=2),
         "placement tags × auto × pipeline is unsupported"),
        (ParallelConfig(strategy_tags=True, enable_parallel_optimizer=True),
         "placement tags × optimizer × tensor is unsupported: not built yet"),
        (ParallelConfig(enable_parallel_optimizer=True, pipeline_degree=2, micro_batches=2),
         "placement tags × optimizer × pipeline is unsupported: not built yet"),
    ]:
        with pytest.raises(ValueError, match=match):
            check_placement(bad.resolve(4))
    check_placement(ParallelConfig(search_mode="sharding_propagation").resolve(4))
    with pytest.raises(ValueError, match="got a hetero.place'd model .* pass the tagged model"):
        parallel.parallelize(hetero.place(_tagged()), config)
    tied = tiny_gpt()
    hetero.set_device(tied.tok_emb, "cpu")
    hetero.set_device(tied.lm_head, "device")
    with pytest.raises(ValueError, match="one shared tensor, but module 'tok_emb' places it on "
                                         "cpu and module 'lm_head' on device"):
        parallel.parallelize(tied, config)
    assert not isinstance(tied.tok_emb.weight, DTensor)  # refused before any change


def test_offload_adamw_recasts_semi_auto_dtensors_but_not_optimizer_parallel_ones():
    parallel.init()
    model = parallel.parallelize(tiny_gpt(), ParallelConfig(strategies=load_strategy_file(
        "conf/strategy/gpt_megatron.yaml", dp=1, mp=1))).model
    weight = model.blocks[0].mlp[0].weight
    opt = OffloadAdamW(model.parameters(), lr=LR, param_dtype=torch.bfloat16, kernel=KERNEL)
    assert model.blocks[0].mlp[0].weight is weight and weight.dtype == torch.bfloat16
    assert weight.to_local().dtype == torch.bfloat16 and isinstance(weight, DTensor)
    x, y = batch(0)
    model(x, y)[1].backward()
    assert all(p.grad is None for p in model.parameters())  # the hooks took them
    opt.step()
    # a DTensor the model does not compute with directly (FSDP2's) keeps its dtype: refused
    mesh = weight.device_mesh
    fsdp_like = nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh, [Replicate()]))
    with pytest.raises(ValueError, match="cast the model to torch.bfloat16 before sharding"):
        OffloadAdamW([fsdp_like], param_dtype=torch.bfloat16, kernel=KERNEL)
    setattr(fsdp_like, DTENSOR_COMPUTE_ATTR, True)
    OffloadAdamW([fsdp_like], param_dtype=torch.bfloat16, kernel=KERNEL)
    assert fsdp_like.dtype == torch.bfloat16
