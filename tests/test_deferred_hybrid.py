"""Deferred initialization in ``mode="hybrid_parallel"``: a stack of Megatron blocks that cut
their own slices (``mark_model_parallel(dim=)``), built on the meta device on every rank, gets
each slice bitwise equal to its part of the whole model ``parallel.materialize`` gives one
process with the same seed, and trains like that process (rel 1e-5): alone over ``mp``, with data
parallel beside it, in pipeline stages, with optimizer parallel and with MoE experts; on 2 and 4
gloo ranks. A slice marked without ``dim`` is refused by name before the model changes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import parallel
from distributed import run_ranks
from hybrid_models import HIDDEN, Stack, gathered, megatron_stack, train_on_ranks, train_whole
from parallel import ParallelConfig

SEED, STEPS = 11, 3
FOUR = {
    "mp4": dict(tensor_degree=4),
    "dp2_mp2": dict(data_degree=2, tensor_degree=2),
    "pp2_mp2": dict(pipeline_degree=2, tensor_degree=2, schedule="1f1b", micro_batches=2),
    "dp2_mp2_level1": dict(data_degree=2, tensor_degree=2, enable_parallel_optimizer=True,
                           optimizer_level="level1", parallel_optimizer_threshold=0),
    "dp2_mp2_level3": dict(data_degree=2, tensor_degree=2, enable_parallel_optimizer=True,
                           optimizer_level="level3", parallel_optimizer_threshold=0),
    "moe_ep2_mp2": dict(expert_degree=2, tensor_degree=2),
}
TWO = {"mp2": dict(tensor_degree=2)}


def _whole(moe: bool) -> Stack:
    """The one-process model: ``Stack`` built on the meta device, materialized from ``SEED``."""
    with torch.device("meta"):
        model = Stack(moe=moe)
    return parallel.materialize(model, seed=SEED, device="cpu")


def _train(fields: dict[str, Any], world: int, moe: bool) -> dict[str, Any]:
    config = ParallelConfig(**fields)
    resolved = config.resolve(world)
    mp = parallel.mesh.parallel_mesh(resolved)["tp"]
    with torch.device("meta"):
        model = megatron_stack(mp.get_group(), mp.get_local_rank(), resolved.tensor_degree, moe,
                               fresh=True)
    staged = resolved.pipeline_degree > 1
    wrapped = parallel.parallelize(model, config, init_seed=SEED,
                                   loss_fn=F.cross_entropy if staged else None).model
    held = {n: tuple(p.to_local().shape if hasattr(p, "to_local") else p.shape)
            for n, p in wrapped.named_parameters()}
    initial = gathered(wrapped, mp.get_group())
    losses = train_on_ranks(wrapped, resolved, STEPS)
    return {"initial": initial, "losses": losses, "held": held}


def _refusal(world: int) -> dict[str, Any]:
    config = ParallelConfig(tensor_degree=world)
    mp = parallel.mesh.parallel_mesh(config.resolve(world))["tp"]
    with torch.device("meta"):
        model = megatron_stack(mp.get_group(), mp.get_local_rank(), world, fresh=True)
    parallel.mark_model_parallel(model.blocks[0].fc2.weight)  # the mark without dim=
    names = [n for n, _ in model.named_parameters()]
    try:
        parallel.parallelize(model, config, init_seed=SEED)
    except ValueError as err:
        return {"error": str(err), "untouched": names == [n for n, _ in model.named_parameters()]
                and all(p.is_meta for p in model.parameters())}
    return {"error": None}


def _ranks(rank: int, world: int, cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    parallel.init()
    return {"cases": {name: _train(fields, world, name.startswith("moe"))
                      for name, fields in cases.items()},
            "refusal": _refusal(world)}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_ranks(_ranks, 2, TWO, timeout=300)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return run_ranks(_ranks, 4, FOUR, timeout=300)


def _check(results: list[dict[str, Any]], case: str, fields: dict[str, Any]) -> None:
    whole = _whole(case.startswith("moe"))
    want_init = {n: p.detach().clone() for n, p in whole.named_parameters()}
    want_losses, _ = train_whole(whole, STEPS, 0.1)
    seen = set()
    for result in results:
        got = result["cases"][case]
        for name, value in got["initial"].items():  # bitwise: the same slices of one model
            assert torch.equal(value, want_init[name]), f"{case} {name} differs at init"
        seen |= set(got["initial"])
        assert got["losses"] == pytest.approx(want_losses, rel=1e-5)
        mp = fields["tensor_degree"]
        for name, shape in got["held"].items():  # a rank holds its slice, never the whole
            if name.endswith("fc1.weight"):
                assert shape[0] <= HIDDEN // mp, (case, name, shape)
            if name.endswith("fc2.weight"):
                assert shape[1] == HIDDEN // mp, (case, name, shape)
    assert seen == set(want_init)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(TWO))
def test_hybrid_slices_initialize_as_the_whole_model_on_two_ranks(two_ranks, case):
    _check(two_ranks, case, TWO[case])


@pytest.mark.slow
@pytest.mark.parametrize("case", list(FOUR))
def test_hybrid_slices_initialize_as_the_whole_model_on_four_ranks(four_ranks, case):
    _check(four_ranks, case, FOUR[case])


@pytest.mark.slow
def test_a_slice_marked_without_dim_is_refused_by_name(two_ranks, four_ranks):
    for result in [*two_ranks, *four_ranks]:
        refusal = result["refusal"]
        assert refusal["error"] is not None
        assert "'blocks.0.fc2.weight' is marked with parallel.mark_model_parallel without " \
            "dim=" in refusal["error"]
        assert refusal["untouched"]


def test_mark_model_parallel_checks_dim_and_marks_nothing_on_a_bad_one():
    from parallel.hybrid_parallel import is_model_parallel, split_dim
    a, b = torch.zeros(4, 2), torch.zeros(3)
    with pytest.raises(ValueError, match=r"dim=1 is not a dimension of a tensor of shape \(3,\)"):
        parallel.mark_model_parallel(a, b, dim=1)
    assert not is_model_parallel(a) and not is_model_parallel(b)
    parallel.mark_model_parallel(a, dim=-1)
    assert split_dim(a) == 1
    parallel.mark_model_parallel(a)  # marked again without dim: no split recorded
    assert is_model_parallel(a) and split_dim(a) is None
