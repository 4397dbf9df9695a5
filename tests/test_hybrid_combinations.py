"""hybrid_parallel × pipeline stages and × MoE experts, equal to one process (rel 1e-5), from one
spawn of 4 gloo ranks: a stack of Megatron blocks whose own collectives span the ``mp`` group of
the stage that holds them (``parallel_mesh(config)["tp"]``), the framework broadcasting per stage
and reducing gradients over the stage's ``dp``:

* pp 2 × mp 2 under ``1f1b``, ``interleaved_1f1b`` (two stages per rank) and ``zbv`` (the split
  backward runs the model's collectives once each, in the input pass);
* pp 2 × dp 2 (mp 1): each stage's replicas feed their halves and average gradients, or
  (optimizer parallel, level2) shard the optimizer and gradients over the stage's dp;
* MoE blocks between the Megatron blocks: experts sharded over ep 2 beside mp 2 (the
  framework's all-to-alls per mp coordinate), routing agreed over dp 2 beside mp 2
  (expert_degree 1), and experts over ep 2 in pipeline stages; with ``multi_copy=2`` the MoE
  layers' dispatch, experts and combine run in two copies (a dense hybrid model is refused by
  name: its collectives are its own);
* hetero placement tags (the head on the host) with dp 2 × mp 2: placed by whole modules, so the
  model's own autograd Functions (gradient all-reduce in backward) run as written.

The refusals (nothing marked, unequal replicated tensors over a stage's mp) are checked there
too, before the model changes.
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
from hybrid_models import Stack, gathered, megatron_stack, stack_reference, train_on_ranks
from parallel import ParallelConfig
from parallel.nn.moe import MoE
from torch_features import runs_here, zbv_params

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
    "moe_ep2_mp2": dict(expert_degree=2, tensor_degree=2),
    "moe_dp2_mp2": dict(data_degree=2, tensor_degree=2),
    "moe_ep2_mp2_copies": dict(expert_degree=2, tensor_degree=2, multi_copy=2),
    "placed_dp2_mp2": dict(data_degree=2, tensor_degree=2),
    "moe_1f1b_ep2": dict(pipeline_degree=2, expert_degree=2, schedule="1f1b", micro_batches=2),
}


def _train(fields: dict[str, Any], world: int, moe: bool, placed: bool) -> dict[str, Any]:
    config = ParallelConfig(**fields)
    resolved = config.resolve(world)
    mp = parallel.mesh.parallel_mesh(resolved)["tp"]  # this rank's (stage's) model-parallel group
    model = megatron_stack(mp.get_group(), mp.get_local_rank(), resolved.tensor_degree, moe)
    with torch.no_grad():  # replicated tensors off rank 0's: the broadcast over mp undoes it
        if mp.get_local_rank() > 0:
            model.head.bias.add_(1.0)
    if placed:
        hetero.set_device(model.head, "cpu")
    staged = resolved.pipeline_degree > 1
    wrapped = parallel.parallelize(model, config,
                                   loss_fn=F.cross_entropy if staged else None).model
    losses = train_on_ranks(wrapped, resolved, STEPS)
    return {"losses": losses, "params": gathered(wrapped, mp.get_group()),
            "stages": wrapped.stage_indices if staged else [],
            "wrapper": type(wrapped).__name__,
            "inner": type(getattr(wrapped, "module", wrapped)).__name__,
            "copies": sorted({m.copies for m in wrapped.modules() if isinstance(m, MoE)}),
            "dtensors": sorted(n for n, p in wrapped.named_parameters()
                               if isinstance(p, DTensor))}


def _refusals(world: int) -> dict[str, str]:
    errors = {}
    config = ParallelConfig(pipeline_degree=2, tensor_degree=2,
                            micro_batches=2)
    try:  # nothing marked: the broadcast over mp would overwrite the slices
        parallel.parallelize(Stack(), config, loss_fn=F.cross_entropy)
    except ValueError as err:
        errors["unmarked"] = str(err)
    mp = parallel.mesh.parallel_mesh(config.resolve(world))["tp"]
    unequal = megatron_stack(mp.get_group(), mp.get_local_rank(), 2)
    with torch.no_grad():
        if mp.get_local_rank() == 1:
            unequal.head.bias.add_(1.0)
    names = [n for n, _ in unequal.named_parameters()]
    try:  # without broadcast, replicated tensors must already agree over the stage's mp
        parallel.parallelize(unequal, ParallelConfig(
            pipeline_degree=2, tensor_degree=2, micro_batches=2,
            parameter_broadcast=False), loss_fn=F.cross_entropy)
    except ValueError as err:
        errors["unequal"] = str(err)
    errors["untouched"] = names == [n for n, _ in unequal.named_parameters()]
    dense = megatron_stack(mp.get_group(), mp.get_local_rank(), 2)
    before = {n: p.detach().clone() for n, p in dense.named_parameters()}
    try:
        parallel.parallelize(dense, ParallelConfig(tensor_degree=2,
                                                   multi_copy=2))
    except ValueError as err:
        errors["copies"] = str(err)
    errors["untouched"] &= all(torch.equal(p, before[n]) for n, p in dense.named_parameters())
    return errors


def _four_ranks(rank: int, world: int) -> dict[str, Any]:
    parallel.init()
    return {"cases": {name: _train(fields, world, name.startswith("moe"),
                                   name.startswith("placed"))
                      for name, fields in CASES.items() if runs_here(fields)},
            "errors": _refusals(world)}


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return run_ranks(_four_ranks, 4, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("case", zbv_params(CASES))
def test_hybrid_pipeline_stages_and_experts_train_like_one_process(four_ranks, case):
    want_losses, want = stack_reference(STEPS, moe=case.startswith("moe"))
    held = set()
    for result in four_ranks:
        got = result["cases"][case]
        assert got["losses"] == pytest.approx(want_losses, rel=1e-5)
        for name, value in got["params"].items():
            torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name: f"{case} {name}: {m}")
        held |= set(got["params"])
    assert held == set(want)  # the stages hold the whole model between them
    fields = CASES[case]
    per_rank = 0 if fields.get("pipeline_degree", 1) == 1 else \
        1 if fields["schedule"] == "1f1b" else 2
    assert {len(r["cases"][case]["stages"]) for r in four_ranks} == {per_rank}
    if not per_rank:  # experts (or routing) over the batch ranks, the rest averaged over them
        assert {r["cases"][case]["wrapper"] for r in four_ranks} == {"DataParallel"}
    if case.startswith("placed"):
        assert {r["cases"][case]["inner"] for r in four_ranks} == {"HookPlacedModule"}
    if "multi_copy" in fields:
        assert all(r["cases"][case]["copies"] == [2] for r in four_ranks)
    if fields.get("expert_degree", 1) > 1:  # each rank holds its 2 of the 4 experts
        for result in four_ranks:
            got = result["cases"][case]
            experts = {n for n in got["params"] if ".experts." in n}
            assert experts and experts <= set(got["dtensors"])


@pytest.mark.slow
def test_hybrid_pipeline_refuses_by_name_before_changing_the_model(four_ranks):
    for result in four_ranks:
        errors = result["errors"]
        assert "no parameter of Stack is marked with parallel.mark_model_parallel" in \
            errors["unmarked"]
        assert errors["unequal"].startswith(
            "hybrid_parallel(parameter_broadcast=False) over 'mp': 'head.bias' on rank 1 "
            "differs from rank 0's")
        assert "multi_copy in hybrid_parallel splits MoE layers' expert work" in \
            errors["copies"]
        assert errors["untouched"]
