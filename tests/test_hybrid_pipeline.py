"""hybrid_parallel × pipeline stages, equal to one process (rel 1e-5), from one spawn of 4 gloo
ranks: a stack of Megatron blocks whose own collectives span the ``mp`` group of the stage that
holds them (``parallel_mesh(config)["tp"]``), the framework broadcasting per stage and reducing
gradients over the stage's ``dp``:

* pp 2 × mp 2 under ``1f1b``, ``interleaved_1f1b`` (two stages per rank) and ``zbv`` (the split
  backward runs the model's collectives once each, in the input pass);
* pp 2 × dp 2 (mp 1): each stage's replicas feed their halves and average gradients, or
  (optimizer parallel, level2) shard the optimizer and gradients over the stage's dp.

The refusals (nothing marked, unequal replicated tensors over a stage's mp) are checked there
too, before the model changes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import parallel
from distributed import run_ranks
from hybrid_models import BATCH, Stack, gathered, megatron_stack, stack_reference
from hybrid_models import batch as mlp_batch
from parallel import ParallelConfig

STEPS = 3
CASES = {
    "1f1b_mp2": dict(pipeline_degree=2, tensor_degree=2, schedule="1f1b", micro_batches=2),
    "interleaved_mp2": dict(pipeline_degree=2, tensor_degree=2, schedule="interleaved_1f1b",
                            micro_batches=4),
    "zbv_mp2": dict(pipeline_degree=2, tensor_degree=2, schedule="zbv", micro_batches=4),
    "1f1b_dp2": dict(pipeline_degree=2, data_degree=2, schedule="1f1b", micro_batches=2),
    "1f1b_dp2_sharded": dict(pipeline_degree=2, data_degree=2, schedule="1f1b", micro_batches=2,
                             enable_parallel_optimizer=True, optimizer_level="level2",
                             parallel_optimizer_threshold=0),
}


def _train(fields: dict[str, Any], world: int) -> dict[str, Any]:
    config = ParallelConfig(mode="hybrid_parallel", **fields)
    resolved = config.resolve(world)
    mesh = parallel.parallel_mesh(resolved)
    mp = mesh["tp"]  # this rank's stage's model-parallel group
    model = megatron_stack(mp.get_group(), mp.get_local_rank(), resolved.tensor_degree)
    with torch.no_grad():  # replicated tensors off rank 0's: the broadcast over mp undoes it
        if mp.get_local_rank() > 0:
            model.head.bias.add_(1.0)
    pipe = parallel.parallelize(model, config, loss_fn=F.cross_entropy).model
    per = BATCH // resolved.data_degree
    start = mesh["dp"].get_local_rank() * per
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        x, y = mlp_batch(step)
        opt.zero_grad()
        losses.append(pipe.step(x[start:start + per], target=y[start:start + per]).item())
        opt.step()
    return {"losses": losses, "params": gathered(pipe, mp.get_group()),
            "stages": pipe.stage_indices}


def _refusals(world: int) -> dict[str, str]:
    errors = {}
    config = ParallelConfig(mode="hybrid_parallel", pipeline_degree=2, tensor_degree=2,
                            micro_batches=2)
    try:  # nothing marked: the broadcast over mp would overwrite the slices
        parallel.parallelize(Stack(), config, loss_fn=F.cross_entropy)
    except ValueError as err:
        errors["unmarked"] = str(err)
    mp = parallel.parallel_mesh(config.resolve(world))["tp"]
    unequal = megatron_stack(mp.get_group(), mp.get_local_rank(), 2)
    with torch.no_grad():
        if mp.get_local_rank() == 1:
            unequal.head.bias.add_(1.0)
    names = [n for n, _ in unequal.named_parameters()]
    try:  # without broadcast, replicated tensors must already agree over the stage's mp
        parallel.parallelize(unequal, ParallelConfig(
            mode="hybrid_parallel", pipeline_degree=2, tensor_degree=2, micro_batches=2,
            parameter_broadcast=False), loss_fn=F.cross_entropy)
    except ValueError as err:
        errors["unequal"] = str(err)
    errors["untouched"] = names == [n for n, _ in unequal.named_parameters()]
    return errors


def _four_ranks(rank: int, world: int) -> dict[str, Any]:
    parallel.init()
    return {"cases": {name: _train(fields, world) for name, fields in CASES.items()},
            "errors": _refusals(world)}


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return run_ranks(_four_ranks, 4, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_hybrid_pipeline_stages_train_like_one_process(four_ranks, case):
    want_losses, want = stack_reference(STEPS)
    held = set()
    for result in four_ranks:
        got = result["cases"][case]
        assert got["losses"] == pytest.approx(want_losses, rel=1e-5)
        for name, value in got["params"].items():
            torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name: f"{case} {name}: {m}")
        held |= set(got["params"])
    assert held == set(want)  # the stages hold the whole model between them
    stages = {len(r["cases"][case]["stages"]) for r in four_ranks}
    assert stages == ({1} if case.startswith("1f1b") else {2})


@pytest.mark.slow
def test_hybrid_pipeline_refuses_by_name_before_changing_the_model(four_ranks):
    for result in four_ranks:
        errors = result["errors"]
        assert "no parameter of Stack is marked with parallel.mark_model_parallel" in \
            errors["unmarked"]
        assert errors["unequal"].startswith(
            "hybrid_parallel(parameter_broadcast=False) over 'mp': 'head.bias' on rank 1 "
            "differs from rank 0's")
        assert errors["untouched"]
