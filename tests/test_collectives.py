"""Each collective's values and gradients on 2 and 4 gloo ranks, against a single-process
computation of what every rank should hold."""

from __future__ import annotations

import pytest
import torch

import parallel
from distributed import run_ranks
from parallel import collectives


def _input(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(float(torch.Size(shape).numel())).view(shape) + 100.0 * rank


def _upstream(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(rank))


# name -> (input shape for `world` ranks, function of (x, world))
CASES = {
    "all_reduce_sum": (lambda w: (2, 3), lambda x, w: collectives.all_reduce(x, op="sum")),
    "all_reduce_mean": (lambda w: (2, 3), lambda x, w: collectives.all_reduce(x, op="mean")),
    "all_gather_dim1": (lambda w: (2, 3), lambda x, w: collectives.all_gather(x, dim=1)),
    "reduce_scatter_dim1": (lambda w: (2, 2 * w),
                            lambda x, w: collectives.reduce_scatter(x, dim=1)),
    "reduce_scatter_mean": (lambda w: (2 * w, 3),
                            lambda x, w: collectives.reduce_scatter(x, op="mean")),
    "broadcast_from_last": (lambda w: (2, 3), lambda x, w: collectives.broadcast(x, src=w - 1)),
    "all_to_all_0_to_1": (lambda w: (2 * w, 3),
                          lambda x, w: collectives.all_to_all(x, split_dim=0, concat_dim=1)),
    "all_to_all_1_to_0": (lambda w: (3, 2 * w),
                          lambda x, w: collectives.all_to_all(x, split_dim=1, concat_dim=0)),
}


def _run_all_cases(rank, world):
    parallel.init()
    out = {}
    for name, (shape_of, fn) in CASES.items():
        x = _input(rank, shape_of(world)).requires_grad_()
        y = fn(x, world)
        y.backward(_upstream(rank, tuple(y.shape)))
        out[name] = (y.detach(), x.grad)
    return out


def _expected(name: str, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Values and input gradients per rank, computed in one process from every rank's data."""
    shape = CASES[name][0](world)
    xs = [_input(r, shape) for r in range(world)]
    total = sum(xs)
    if name.startswith("all_reduce"):
        scale = 1.0 / world if name.endswith("mean") else 1.0
        gs = [_upstream(r, shape) for r in range(world)]
        return [(total * scale, sum(gs) * scale)] * world
    if name == "all_gather_dim1":
        out = torch.cat(xs, dim=1)
        gs = sum(_upstream(r, tuple(out.shape)) for r in range(world))
        return [(out, gs.chunk(world, dim=1)[r]) for r in range(world)]
    if name.startswith("reduce_scatter"):
        dim = 1 if name.endswith("dim1") else 0
        scale = 1.0 / world if name.endswith("mean") else 1.0
        outs = [c * scale for c in total.chunk(world, dim=dim)]
        grad = torch.cat([_upstream(r, tuple(outs[r].shape)) for r in range(world)], dim=dim)
        return [(outs[r], grad * scale) for r in range(world)]
    if name == "broadcast_from_last":
        grad = sum(_upstream(r, shape) for r in range(world))
        return [(xs[-1], grad if r == world - 1 else torch.zeros(shape)) for r in range(world)]
    split, concat = (0, 1) if name == "all_to_all_0_to_1" else (1, 0)
    pieces = [x.chunk(world, dim=split) for x in xs]  # pieces[src][dst]
    outs = [torch.cat([pieces[src][dst] for src in range(world)], dim=concat)
            for dst in range(world)]
    ups = [_upstream(r, tuple(outs[r].shape)).chunk(world, dim=concat) for r in range(world)]
    grads = [torch.cat([ups[dst][src] for dst in range(world)], dim=split) for src in range(world)]
    return list(zip(outs, grads, strict=True))


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}ranks")
def ranks_results(request):
    world = request.param
    return world, run_ranks(_run_all_cases, world, timeout=180)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_values_and_gradients(ranks_results, name):
    world, results = ranks_results
    for rank, (want_value, want_grad) in enumerate(_expected(name, world)):
        value, grad = results[rank][name]
        torch.testing.assert_close(value, want_value, msg=f"{name} value on rank {rank}")
        torch.testing.assert_close(grad, want_grad, msg=f"{name} gradient on rank {rank}")


def test_single_rank_collectives_are_identity():
    parallel.init()
    x = torch.randn(4, 6, requires_grad=True)
    for y in (collectives.all_reduce(x), collectives.all_gather(x, dim=1), collectives.broadcast(x),
              collectives.reduce_scatter(x, dim=1), collectives.all_to_all(x, 1, 0)):
        torch.testing.assert_close(y, x)
    collectives.all_gather(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones_like(x))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda x: collectives.all_reduce(x, op="avg"), "all_reduce: op must be one of"),
        (lambda x: collectives.reduce_scatter(x, op="max"), "reduce_scatter: op must be one of"),
        (lambda x: collectives.broadcast(x, src=3), "src=3 is not a rank of a group of size 1"),
        (lambda x: collectives.all_gather(x, dim=5), "dim 5 is out of range"),
        (lambda x: collectives.all_to_all(torch.tensor(1.0)), "at least one dimension"),
    ],
)
def test_bad_arguments_are_named(call, message):
    parallel.init()
    with pytest.raises(ValueError, match=message):
        call(torch.ones(4, 6))


def _uneven_split(rank, world):
    parallel.init()
    try:
        collectives.reduce_scatter(torch.ones(3, 5), dim=1)
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.slow
def test_uneven_split_is_refused_before_communicating():
    messages = run_ranks(_uneven_split, 2)
    assert all("must split evenly into 2 parts" in m for m in messages)
