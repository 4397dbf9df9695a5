"""The recipes' ``offload`` group: every setting trains with the losses of the run without it (one
process and data parallel), checkpoints resume across settings, the previous release's
``hetero=offload`` still works with a warning, and impossible combinations are refused by name
before any process group."""

from __future__ import annotations

import re

import pytest
import torch

from recipe_helpers import TINY, compose_train, losses_of, run_recipe, train_in_process
from recipes.run_settings import check_run_settings
from torch_features import runs_here

STEPS = ["trainer.max_steps=4", "model.n_layer=2", "trainer.log_every=1"]


def _losses(tmp_path, name: str, args: list[str]) -> list[float]:
    run = tmp_path / name
    hf = "model=hf" in args  # its own model keys: no GPT sizes
    train_in_process([*(s for s in STEPS if not (hf and s.startswith("model."))),
                      "parallel=none", *args], run, tmp_path / "data",
                     tiny=[t for t in TINY if not (hf and t.startswith("model."))])
    found = losses_of(run)
    return [found[s] for s in sorted(found)]


def test_every_offload_setting_trains_like_none(tmp_path):
    want = _losses(tmp_path, "none", [])
    assert len(want) == 4 and want[-1] < want[0]
    # FP32 weights: the same losses (the host optimizer's kernel rounds its own way)
    for name, args in {"params": ["offload=params"],
                       "params, prefetch 0": ["offload=params", "offload.prefetch=0"],
                       "activations": ["offload=activations"],
                       "recompute=offload": ["trainer.recompute=offload"],
                       "optimizer fp32": ["offload=optimizer", "offload.param_dtype=null"],
                       "optimizer ratio 0.5": ["offload=optimizer", "offload.param_dtype=null",
                                               "offload.ratio=0.5"],
                       "params + activations": ["offload=params", "offload.activations=host"],
                       "disk": ["offload=disk"],
                       "disk, own path": ["offload=disk", f"offload.path={tmp_path / 'nvme'}"],
                       "params, state on disk": ["offload=params", "offload.optimizer=disk"],
                       "params on disk": ["offload=params", "offload.params=disk"],
                       "params and state on disk": ["offload=disk", "offload.params=disk"],
                       }.items():
        assert _losses(tmp_path, name, args) == pytest.approx(want, rel=1e-6), name


def test_parameter_offload_takes_meta_init_and_hf_models(tmp_path):
    meta = ["model.init_device=meta"]
    assert _losses(tmp_path, "meta+params", ["offload=params", *meta]) == pytest.approx(
        _losses(tmp_path, "meta", meta), rel=1e-6)
    llama = ["model=hf", "model.config={model_type: llama, hidden_size: 32, num_hidden_layers: "
             "2, num_attention_heads: 4, num_key_value_heads: 2, intermediate_size: 64}"]
    want = _losses(tmp_path, "llama", llama)
    for name, args in {"params": ["offload=params"], "activations": ["offload=activations"],
                       "ratio": ["offload=optimizer", "offload.param_dtype=null",
                                 "offload.ratio=0.5"]}.items():
        assert _losses(tmp_path, f"llama {name}", [*llama, *args]) == pytest.approx(
            want, rel=1e-6), name


def test_16_bit_weights_on_the_device_train_alike_whichever_state_is_offloaded(tmp_path):
    bf16 = ["offload.param_dtype=bfloat16"]
    optimizer = _losses(tmp_path, "optimizer", ["offload=optimizer", *bf16])
    params = _losses(tmp_path, "params", ["offload=params", *bf16])
    assert params == pytest.approx(optimizer, rel=1e-3)  # both compute in bf16


def test_fp16_under_parameter_offload_is_loss_scaled_as_under_optimizer_offload(tmp_path):
    """The host gradients of offloaded weights go through the same loss scaler (scaled loss,
    unscaled and checked host gradients, skipped overflowing steps): fp16 autocast over FP32
    weights gives the optimizer offload's losses, and fp16 device copies train alike."""
    fp16 = ["trainer.precision=fp16"]
    want = _losses(tmp_path, "optimizer fp16", [*HOST_ADAM, *fp16])
    assert _losses(tmp_path, "params fp16", ["offload=params", *fp16]) == pytest.approx(
        want, rel=1e-6)
    # fp16 device copies of host weights (the optimizer's own weights FP32): scaled too
    from torch import nn

    from hetero.optim import LossScaler, OffloadAdamW
    from recipes.precision import build_scaler
    host_weights = OffloadAdamW(nn.Linear(2, 2).parameters(), param_dtype=None)
    assert build_scaler("fp32", host_weights, torch.device("cpu")) is None
    assert isinstance(build_scaler("fp32", host_weights, torch.device("cpu"), torch.float16),
                      LossScaler)
    halves = ["offload.param_dtype=float16"]
    want = _losses(tmp_path, "optimizer halves", ["offload=optimizer", *halves])
    assert _losses(tmp_path, "params halves", ["offload=params", *halves]) == pytest.approx(
        want, rel=1e-3)  # both compute in fp16


def test_the_previous_spelling_warns_and_trains_as_offload_optimizer(tmp_path):
    with pytest.warns(DeprecationWarning, match="use offload=optimizer"):
        check_run_settings(compose_train(["hetero=offload"]))
    old = _losses(tmp_path, "old", ["hetero=offload"])
    assert old == _losses(tmp_path, "new", ["offload=optimizer"])


HOST_ADAM = ["offload=optimizer", "offload.param_dtype=null"]


@pytest.mark.parametrize("first, then", [
    (["offload=params"], [*HOST_ADAM, "offload.activations=host"]),  # weights host -> device
    (HOST_ADAM, ["offload=params"]),  # device -> host
])
def test_a_checkpoint_resumes_across_offload_settings(tmp_path, first, then):
    """Bit for bit: where the weights and activations lived changes no value (the optimizer,
    OffloadAdamW, is the same: a resume into another optimizer class is refused by name)."""
    cache = tmp_path / "data"
    whole = tmp_path / "whole"
    train_in_process([*STEPS, "parallel=none", *then], whole, cache)
    half = tmp_path / "half"
    train_in_process([*STEPS, "parallel=none", *first, "trainer.max_steps=2"], half, cache)
    rest = tmp_path / "rest"
    train_in_process([*STEPS, "parallel=none", *then,
                      f"trainer.resume_from={half / 'checkpoints' / 'step_000002'}"],
                     rest, cache)
    want = losses_of(whole)
    got = {**losses_of(half), **losses_of(rest)}
    assert [got[s] for s in sorted(got)] == [want[s] for s in sorted(want)] and len(got) == 4


@pytest.mark.parametrize("overrides, message", [
    (["offload=params", "parallel=semi_auto"], "offload.params=host cannot train with"),
    (["offload=params", "offload.optimizer=disk", "trainer.precision=fp16"],
     "fp16 with offload.optimizer=disk"),
    (["offload=params", "offload.param_dtype=float16", "parallel=data",
      "parallel.enable_parallel_optimizer=true", "parallel.optimizer_level=level1"],
     "fp16 with optimizer parallel level1"),
    (["offload=activations", "trainer.recompute=full"], "a block does one or the other"),
    (["offload.param_dtype=bfloat16"], "keeps none there"),
    (["offload=optimizer", "offload.ratio=0.5"], "one model in two dtypes needs autocast"),
    (["offload=params", "offload.optimizer=device"], "needs optimizer='host'"),
    (["offload=optimizer", "hetero.param_dtype=float16"], "disagree"),
    (["offload=disk", "parallel=semi_auto"], "offload.optimizer=disk cannot train with"),
    (["offload=params", "offload.param_dtype=bfloat16", "parallel=data",
      "parallel.enable_parallel_optimizer=true", "parallel.optimizer_level=level2"],
     "its FP32 weights"),
    (["offload=disk", "offload.param_dtype=bfloat16"], "the model keeps its dtype"),
    (["offload=disk", "optim=sgd"], "the disk tier steps AdamW"),
    (["offload.path=/tmp"], "is where params='disk' and optimizer='disk' keep their files"),
])
def test_impossible_offload_settings_are_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        check_run_settings(compose_train(["parallel=none", *overrides]))


@pytest.mark.slow
def test_parameter_offload_in_stages_with_replicas_trains_like_the_layout_without_it(tmp_path):
    """``parallel=hybrid`` (2 stages x 2 data-parallel replicas on 4 ranks): each stage's
    weights at rest on the host, its gradients landed there and averaged over its replicas
    after the schedule; with optimizer parallel level1, Adam's moments sharded over those
    replicas (``ShardedHostAdamW``); the losses of the same layout without offload. And under
    zbv with level3, whose shards rest on the host."""
    level1 = ["parallel.enable_parallel_optimizer=true", "parallel.optimizer_level=level1"]
    for name, args in {"hybrid": [], "offload": ["offload=params"],
                       "level1": ["offload=params", *level1]}.items():
        run_recipe([*STEPS, "parallel=hybrid", *args], 4, tmp_path / name, tmp_path / "data")
    want = losses_of(tmp_path / "hybrid")
    host = {}
    for name in ("offload", "level1"):
        got = losses_of(tmp_path / name)
        assert sorted(got) == [1, 2, 3, 4]
        assert [got[s] for s in sorted(got)] == pytest.approx(
            [want[s] for s in sorted(want)], rel=1e-6), name
        log = (tmp_path / name / "train.log").read_text()
        assert "parameter offload: 1 layers" in log
        host[name] = float(re.search(r"memory plan per rank: device [\d.]+ MiB, host ([\d.]+) "
                                     r"MiB", log).group(1))
    # weights and gradients whole on each host; the moments (8 B a parameter) halved
    assert host["level1"] < host["offload"] * 0.75, host
    if not runs_here("zbv"):
        return
    # zbv's split backward over level3's shards at rest on the host (FSDP2's offload)
    zbv = ["parallel.schedule=zbv", "model.n_layer=4", "parallel.enable_parallel_optimizer=true",
           "parallel.optimizer_level=level3"]
    for name, args in {"zbv": zbv, "zbv_offload": [*zbv, "offload=params"]}.items():
        run_recipe([*STEPS, "parallel=hybrid", *args], 4, tmp_path / name, tmp_path / "data")
    got, want = losses_of(tmp_path / "zbv_offload"), losses_of(tmp_path / "zbv")
    assert [got[s] for s in sorted(got)] == pytest.approx([want[s] for s in sorted(want)],
                                                          rel=1e-6)


@pytest.mark.slow
def test_parameter_offload_trains_on_two_ranks_like_the_same_layout_without_it(tmp_path):
    cache = tmp_path / "data"
    level1 = ["parallel.enable_parallel_optimizer=true", "parallel.optimizer_level=level1"]
    runs = {"data": ["parallel=data"],  # accumulated: each rank's host sums reduced once
            "offload": ["parallel=data", "offload=params", "trainer.grad_accum_steps=2"],
            "level1": ["parallel=data", "offload=params", *level1,
                       "trainer.checkpoint_every=2"],
            "disk": ["parallel=data", "offload=disk", "model.init_device=meta",  # each rank
                     "parallel.enable_parallel_optimizer=true",  # its shards' state on disk
                     "parallel.optimizer_level=level3", "trainer.checkpoint_every=2"],
            "level3": ["parallel=data", "offload=params",  # each rank's shards on its host
                       "parallel.enable_parallel_optimizer=true",
                       "parallel.optimizer_level=level3", "trainer.checkpoint_every=2"],
            "data_meta": ["parallel=data", "model.init_device=meta"],
            "pipeline": ["parallel=pipeline"],
            "pipeline_offload": ["parallel=pipeline", "offload=params"],
            # two stages a rank (four layers), backward split into input and weight passes
            "zbv": ["parallel=pipeline", "parallel.schedule=zbv", "model.n_layer=4"],
            "zbv_offload": ["parallel=pipeline", "parallel.schedule=zbv", "model.n_layer=4",
                            "offload=params"]}
    runs = {name: args for name, args in runs.items() if runs_here(args)}
    for name, args in runs.items():
        run_recipe([*STEPS, *args], 2, tmp_path / name, cache)
    for name in ("level1", "level3", "disk"):  # resumed from step 2: the same steps 3 and 4
        resumed = tmp_path / f"{name}_resumed"
        run_recipe([*STEPS, *runs[name], "trainer.resume_from="
                    f"{tmp_path / name / 'checkpoints' / 'step_000002'}"], 2, resumed, cache)
        got, want = losses_of(resumed), losses_of(tmp_path / name)
        assert sorted(got) == [3, 4] and all(got[s] == want[s] for s in got), name
    for name, like in (("offload", "data"), ("level1", "data"), ("level3", "data"),
                       ("disk", "data_meta"),
                       ("pipeline_offload", "pipeline"), ("zbv_offload", "zbv")):
        if name not in runs:
            continue
        got, want = losses_of(tmp_path / name), losses_of(tmp_path / like)
        assert [got[s] for s in sorted(got)] == pytest.approx(
            [want[s] for s in sorted(want)], rel=1e-6), name
    log = (tmp_path / "offload" / "train.log").read_text()
    assert "gradients averaged over 2 ranks" in log
    assert "memory plan per rank: device" in log and "host 0.0 MiB" not in log
    assert "host 0.0 MiB" not in (tmp_path / "level3" / "train.log").read_text()
