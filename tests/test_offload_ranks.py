"""Parameter offload on 2 gloo ranks (one spawn): data parallel over host gradients, with the
optimizer's moments replicated (fused AdamW) or sharded over the ranks (``ShardedHostAdamW``,
optimizer parallel level1 on the host) — the same bits either way, and the same state — and with
the weights and gradients at rest in a file (``disk_path``); and in the stages of torch's
zero-bubble V schedule, whose split backward computes the weights' gradients in a pass of its
own."""

from __future__ import annotations

import os

import pytest
import torch

import parallel
from distributed import run_ranks
from hetero.offload import ParamOffload
from hetero.offload.sharded_host_adam import ShardedHostAdamW
from parallel import ParallelConfig
from pipeline_helpers import rank_steps, tiny_gpt, train_pipelined
from torch_features import needs_zbv_over_gloo, runs_here

STEPS = 3
KW = dict(lr=1e-2, weight_decay=0.1)


def _train(rank: int, world: int, sharded: bool, disk: bool = False
           ) -> tuple[list[float], dict, dict]:
    import tempfile

    import torch.distributed as dist

    model = tiny_gpt(3)
    directory = tempfile.mkdtemp() if disk else None
    ParamOffload(model, reduce_group=dist.group.WORLD, disk_path=directory)
    if directory is not None:
        os.rmdir(directory)  # empty: the file was unlinked as soon as it was mapped
    opt = (ShardedHostAdamW(model.parameters(), group=dist.group.WORLD, **KW) if sharded
           else torch.optim.AdamW(model.parameters(), fused=True, **KW))
    losses = rank_steps(model, opt, range(STEPS), rank, world)
    state = opt.state_dict()["state"]
    if sharded:  # a resume through DCP's flattened state dicts (what the recipes save) into
        # a fresh optimizer keeps this rank's share exactly
        import copy

        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_state_dict,
            set_state_dict,
        )

        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        opt.zero_grad(set_to_none=True)
        model_sd, optim_sd = get_state_dict(model, opt, options=flat)
        fresh = ShardedHostAdamW(model.parameters(), group=dist.group.WORLD, **KW)
        set_state_dict(model, fresh, model_state_dict=model_sd,
                       optim_state_dict=copy.deepcopy(optim_sd), options=flat)
        assert all(torch.equal(a.exp_avg, b.exp_avg) and torch.equal(a.exp_avg_sq, b.exp_avg_sq)
                   for a, b in zip(opt._ranges, fresh._ranges, strict=True))
    return losses, {k: v.clone() for k, v in model.state_dict().items()}, state


PIPELINES = {schedule: ParallelConfig(pipeline_degree=2, micro_batches=4, schedule=schedule)
             for schedule in ("1f1b", "zbv")}
FP32_COPIES = dict(compute_dtype=torch.float32)  # of an FP64 model: the host's dtype differs


def _cases(rank: int, world: int) -> dict:
    parallel.init()
    out = {name: _train(rank, world, sharded, disk) for name, sharded, disk in
           (("replicated", False, False), ("sharded", True, False),
            ("weights on disk", False, True))}
    if not runs_here("zbv"):
        return out
    for name, schedule, offload in (("zbv", "zbv", None), ("zbv offloaded", "zbv", {})):
        out[name] = train_pipelined(PIPELINES[schedule], STEPS, offload=offload)[:2]
    for schedule in ("zbv", "1f1b"):
        out[f"{schedule} fp32 copies"] = train_pipelined(
            PIPELINES[schedule], STEPS, offload=FP32_COPIES, dtype=torch.float64)[:2]
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_cases, 2, timeout=180)


def _same_losses_and_weights(got: tuple, want: tuple) -> None:
    """Two runs of ``_train`` with the same losses and weights, bit for bit."""
    assert got[0] == want[0]
    assert all(torch.equal(got[1][k], want[1][k]) for k in want[1])


@pytest.mark.slow
def test_sharded_host_moments_train_bit_for_bit_like_replicated_ones(two_ranks):
    for results in two_ranks:
        _same_losses_and_weights(results["sharded"], results["replicated"])
        state, want_state = results["sharded"][2], results["replicated"][2]
        assert state.keys() == want_state.keys()
        for index, entry in state.items():  # the saved state is the unsharded optimizer's
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(entry[key], want_state[index][key]), (index, key)
    assert two_ranks[0]["sharded"][1].keys() == two_ranks[1]["sharded"][1].keys()


@pytest.mark.slow
def test_weights_and_gradients_on_disk_train_bit_for_bit_like_host_ones(two_ranks):
    for results in two_ranks:
        _same_losses_and_weights(results["weights on disk"], results["replicated"])
    for key, value in two_ranks[0]["sharded"][1].items():  # the ranks' weights stay equal
        assert torch.equal(value, two_ranks[1]["sharded"][1][key])


@pytest.mark.slow
@needs_zbv_over_gloo
def test_zero_bubble_stages_with_offloaded_weights_train_like_resident_ones(two_ranks):
    """One offload over the two stages zbv puts on a rank: the first rank's stages share the
    tied embedding and head, which has one home (before, an offload per stage gave it two
    host tensors, and the one stepped was not always the one brought back)."""
    for results in two_ranks:
        got, want = results["zbv offloaded"], results["zbv"]
        assert got[0] == pytest.approx(want[0], rel=1e-6)
        for name, value in want[1].items():
            torch.testing.assert_close(got[1][name], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.slow
@needs_zbv_over_gloo
def test_the_zero_bubble_weight_pass_computes_on_the_device_copies(two_ranks):
    """zbv's weight pass runs after its input pass let the layers go, and no layer hook sees
    it: each group of weights is brought back for it, its gradients land on the host in the
    host's dtype and add to the micro-batches' sum (``OffloadedStage``). With device copies in
    another dtype than the host's (FP32 copies of an FP64 model) this shows on the CPU too:
    before, the pass computed on the FP64 host weights with FP32 activations ("expected scalar
    type Double but found Float"), as it would compute on host weights with device
    activations on an accelerator. It trains as the same offload under 1F1B, whose backward
    is whole."""
    for results in two_ranks:
        got, want = results["zbv fp32 copies"], results["1f1b fp32 copies"]
        assert got[0] == pytest.approx(want[0], rel=1e-6)
        common = got[1].keys() & want[1].keys()  # the layers this rank runs under both
        assert common
        for name in common:
            value = want[1][name]
            torch.testing.assert_close(got[1][name], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")
