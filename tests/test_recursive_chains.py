"""Recursive programming re-lays chains single-operator refinement cannot move (issue 26): on the
recipe GPT the benchmark trains (d_model 192, 4 layers, batch 16 x 64), priced by one cost
model, its plan reaches the dynamic programming's and beats the hand-written Megatron plan,
on 2 and 4 devices, on the default host profile and on one like this 2-core machine's with
4 oversubscribed ranks (``profile_devices()`` measured about 3e10 FLOP/s, 1.3 ms per
collective step, 0.8 GB/s). One process, meta model: no ranks."""

from __future__ import annotations

import pytest
import torch

import parallel
from parallel.auto.cost_model import DEFAULT_PROFILES, DeviceProfile
from parallel.auto.graph import capture_ops
from parallel.auto.propagate import PricedGraph
from parallel.auto.recursive_programming import _Bisection
from parallel.semi_auto import load_strategy_file
from recipes.gpt import GPT
from recipes.parallel_mode import STRATEGY_DIR

OVERSUBSCRIBED = DeviceProfile("cpu", flops=3e10, alpha=1.3e-3, bandwidth=8e8,
                               memory=16 * 2**30)
LAYERS = 4


def _gpt():
    with torch.device("meta"):
        model = GPT(65, 192, LAYERS, 6, 64)
    return model, (torch.randint(0, 65, (16, 64)),)


def _collectives(plan) -> int:
    return sum(len(op.comms) for op in plan.ops)


@pytest.mark.parametrize("profile", [DEFAULT_PROFILES["cpu"], OVERSUBSCRIBED],
                         ids=["default", "oversubscribed"])
@pytest.mark.parametrize("devices", [2, 4])
def test_the_recursive_plan_reaches_the_dp_and_beats_the_hand_written_one(devices, profile):
    """The modelled step is the objective both searches minimise, so that is asserted: at
    most 1.05x the hand-written plan's (the issue's goal, here in the model) and at most 1% above
    the DP's. The collective count is not the objective (the model may pay more, smaller
    collectives to split compute: both searches' plans on the default profile issue 55 against
    the hand-written 12, modelled 0.55-0.75x its step), so it is only bounded: at most two more
    per layer than the fuller of the DP's and the hand-written plan. Before chains moved, the
    recursive plan on 4 devices issued 64 modelled collectives against the DP's 28, at a 28%
    higher modelled step; now, on the oversubscribed profile, all three plans are the same 12
    collectives on 4 devices."""
    model, inputs = _gpt()
    hand = parallel.plan_auto_parallel(model, inputs, device_num=devices, profile=profile,
                                       strategies=load_strategy_file(
                                           STRATEGY_DIR / "gpt_megatron.yaml", dp=1,
                                           mp=devices))
    dp = parallel.plan_auto_parallel(model, inputs, device_num=devices, profile=profile,
                                     search_mode="dynamic_programming")
    rp = parallel.plan_auto_parallel(model, inputs, device_num=devices, profile=profile,
                                     search_mode="recursive_programming")
    assert rp.cost <= 1.05 * hand.cost
    assert rp.cost <= 1.01 * dp.cost
    assert _collectives(rp) <= max(_collectives(dp), _collectives(hand)) + 2 * LAYERS


def test_chains_hold_the_residual_stream_and_layout_keeping_pairs():
    """What moves as one unit: the residual adds (DTensor runs them: each takes its inputs as
    they arrive); each attention, alone (DTensor runs it too); each MLP's first Linear with
    its GELU; and each QKV Linear with the LayerNorm before it (the QKV output is viewed into
    heads, so the Linear may only split the batch: every candidate it has keeps its input's
    layout). Nothing else is grouped."""
    model, inputs = _gpt()
    ops = capture_ops(model, inputs)
    run = _Bisection(PricedGraph(ops, 4, OVERSUBSCRIBED), 0.0)
    chains = [[ops[j].key or ops[j].name for j in chain] for chain in run.chains()]
    layers = [[[f"blocks.{i}.ln1", f"blocks.{i}.attn.qkv"],
               [f"scaled_dot_product_attention{f'_{i}' if i else ''}"],
               [f"blocks.{i}.mlp.0", f"blocks.{i}.mlp.1"]] for i in range(4)]
    assert chains == [["add", *(f"add_{i}" for i in range(1, 9))],
                      *(chain for layer in layers for chain in layer)]
