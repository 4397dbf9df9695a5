"""Parameter offload under optimizer parallel level2/3 (``ParallelConfig(offload_params=True)``):
each rank's shards of the weights and gradients rest in host memory and are gathered to the
device a layer at a time (FSDP2's ``CPUOffloadPolicy``). On 2 gloo ranks it trains as the same
config without offload and as one process (to fp32 reduction order: on gloo those run other
backends' reductions), and a checkpoint written with offload on resumes with it off, and the
other way, with every weight and optimizer state read back bit for bit."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule

import parallel
from distributed import fsdp_param_groups, run_ranks
from parallel import ParallelConfig
from parallel.weights import deferred_init
from pipeline_helpers import full_params, rank_steps, reference, tiny_gpt

STEPS = 4
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _build(level: str, offload: bool, meta: bool = False
           ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    config = ParallelConfig(enable_parallel_optimizer=True, optimizer_level=level,
                            parallel_optimizer_threshold=0, offload_params=offload)
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = tiny_gpt()
    model = parallel.parallelize(model, config, init_seed=3 if meta else None).model
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _offloaded_units(model: torch.nn.Module) -> list[bool]:
    """Whether each FSDP2 unit's parameters rest on the host (FSDP2's own record)."""
    return [param.offload_to_cpu
            for unit in model.modules() if isinstance(unit, FSDPModule)
            for group in fsdp_param_groups(unit)
            for param in group.fsdp_params]


def _full_state(opt: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every optimizer state tensor, whole, keyed by parameter name and state key."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {f"{names[id(p)]}.{key}": (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
            for p, state in opt.state.items() for key, v in state.items()}


def _meta_on_an_accelerator(level: str, rank: int, world: int) -> dict:
    """Deferred init recorded for a device the meta device stands in for (nothing allocated
    there has storage): the shards that rest on the host must be made on the host, the rest
    moved to the mesh's device; then the same steps as the model made on the host."""
    real = deferred_init._record

    def on_meta(model, seed, device, *args):
        return dataclasses.replace(real(model, seed, device, *args), device=torch.device("meta"))

    deferred_init._record = on_meta
    try:
        model, opt = _build(level, True, meta=True)
    finally:
        deferred_init._record = real
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    return {"left_on_meta": left, "units": _offloaded_units(model),
            "losses": rank_steps(model, opt, range(STEPS), rank, world)}


def _train(rank: int, world: int, level: str, path: str) -> dict:
    parallel.init()
    out: dict = {}
    for offload in (False, True):
        model, opt = _build(level, offload)
        losses = rank_steps(model, opt, range(STEPS), rank, world)
        out[offload] = {"losses": losses, "params": full_params(model),
                        "units": _offloaded_units(model),
                        "grads_home": {p.grad.to_local().device.type
                                       for p in model.parameters() if p.grad is not None}}
    # deferred (meta) initialization: each rank allocates only its shards, on the host
    out["meta"] = [rank_steps(*_build(level, offload, meta=True), range(STEPS), rank, world)
                   for offload in (False, True)]
    out["meta_accelerator"] = _meta_on_an_accelerator(level, rank, world)
    # a checkpoint written with offload on resumes with it off, and the other way
    for saved, resumed in ((True, False), (False, True)):
        model, opt = _build(level, saved)
        rank_steps(model, opt, range(STEPS // 2), rank, world)
        model_sd, optim_sd = get_state_dict(model, opt, options=_FLAT)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{path}-{saved}")
        written = (full_params(model), _full_state(opt, model))
        rank_steps(model, opt, range(STEPS // 2, STEPS), rank, world)
        straight = full_params(model)
        model, opt = _build(level, resumed)
        model_sd, optim_sd = get_state_dict(model, opt, options=_FLAT)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=f"{path}-{saved}")
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=_FLAT)
        read = (full_params(model), _full_state(opt, model))
        rank_steps(model, opt, range(STEPS // 2, STEPS), rank, world)
        out[f"resume {saved}->{resumed}"] = (written, read, straight, full_params(model))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("level", ["level2", "level3"])
def test_weights_on_the_host_train_like_on_the_device_and_resume_across_it(level, tmp_path):
    _, params = reference(STEPS)  # one process on the whole batch (each rank's loss: its half)
    for result in run_ranks(_train, 2, level, str(tmp_path / "ckpt"), timeout=300):
        plain, offloaded = result[False], result[True]
        assert offloaded["units"] and all(offloaded["units"])  # FSDP2 keeps them on the host
        assert not any(plain["units"])
        assert offloaded["grads_home"] == {"cpu"}
        # FSDP2's reductions against the gloo backends' (whole weights, resharded level3):
        # equal to fp32 reduction order, as one process is
        torch.testing.assert_close(offloaded["losses"], plain["losses"], rtol=1e-6, atol=0)
        for name, value in params.items():
            torch.testing.assert_close(offloaded["params"][name], value, rtol=1e-4, atol=1e-5,
                                       msg=name)
            torch.testing.assert_close(plain["params"][name], value, rtol=1e-4, atol=1e-5,
                                       msg=name)
        plain_meta, offloaded_meta = result["meta"]
        torch.testing.assert_close(offloaded_meta, plain_meta, rtol=1e-6, atol=0)
        accelerator = result["meta_accelerator"]
        assert accelerator["left_on_meta"] == [] and all(accelerator["units"])
        assert accelerator["losses"] == offloaded_meta  # the same values, made elsewhere
        for key in ("resume True->False", "resume False->True"):
            written, read, straight, resumed = result[key]
            for saved, loaded in zip(written, read, strict=True):  # the state, bit for bit
                assert saved.keys() == loaded.keys()
                for name, value in saved.items():
                    assert torch.equal(loaded[name], value), (key, name)
            for name, value in straight.items():  # then the other setting's reductions
                torch.testing.assert_close(resumed[name], value, rtol=1e-4, atol=1e-5,
                                           msg=f"{key} {name}")


def test_offload_params_is_refused_where_no_backend_takes_it():
    with pytest.raises(ValueError, match="needs optimizer parallel level2 or level3"):
        ParallelConfig(offload_params=True)
    with pytest.raises(ValueError, match="needs optimizer parallel level2 or level3"):
        ParallelConfig(enable_parallel_optimizer=True, offload_params=True)  # level1: whole
    ParallelConfig(enable_parallel_optimizer=True, optimizer_level="level3",  # each stage's
                   offload_params=True, pipeline_degree=2, micro_batches=2)     # shards
    with pytest.raises(ValueError, match="weights on the host with semi-auto sharding"):
        ParallelConfig(enable_parallel_optimizer=True, optimizer_level="level2",
                       offload_params=True, strategies={"blocks.0.mlp.0": ((1, 1), (1, 1))})
