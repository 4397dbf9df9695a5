"""Pipeline gradient clipping reads nothing back to the host per parameter and runs one
collective per kind of gradient (issue 24, finding 14): norms are taken on the device, stacked,
and reduced once; a mesh's sharded gradients cost one collective, not one each."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import parallel.grad_clip as grad_clip
from parallel.pipeline.runtime import Pipeline


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


@pytest.fixture
def counts(monkeypatch):
    """Calls of host read-backs and collectives during the test."""
    seen = {"cpu": 0, "item": 0, "full_tensor": 0, "all_reduce": 0}

    def counting(owner, name, key):
        real = getattr(owner, name)

        def wrapper(*args, **kwargs):
            seen[key] += 1
            return real(*args, **kwargs)
        monkeypatch.setattr(owner, name, wrapper)
    counting(torch.Tensor, "cpu", "cpu")
    counting(torch.Tensor, "item", "item")
    counting(DTensor, "full_tensor", "full_tensor")
    counting(dist, "all_reduce", "all_reduce")
    return seen


def _params(mesh) -> list[tuple[str, torch.nn.Parameter]]:
    torch.manual_seed(0)
    named = []
    for i in range(3):  # sharded over the mesh
        p = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]))
        p.grad = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])
        named.append((f"sharded{i}", p))
    for i in range(2):  # plain
        p = torch.nn.Parameter(torch.randn(5))
        p.grad = torch.randn(5)
        named.append((f"plain{i}", p))
    return named


def _full(g: torch.Tensor) -> torch.Tensor:
    return g.to_local() if isinstance(g, DTensor) else g


def test_pipeline_clip_reads_no_norm_back_and_reduces_once(one_rank, counts):
    named = _params(one_rank)
    before = [_full(p.grad).clone() for _, p in named]
    expected = torch.cat([g.flatten() for g in before]).norm()
    stage = types.SimpleNamespace(named_parameters=lambda: iter(named),
                                  _parts=types.SimpleNamespace(ties=[], pp_group=None))
    counts.update(dict.fromkeys(counts, 0))
    total = Pipeline.clip_grad_norm_(stage, max_norm=0.5)
    assert counts == {"cpu": 0, "item": 0, "full_tensor": 1, "all_reduce": 1}
    torch.testing.assert_close(total, expected)
    for (_, p), g in zip(named, before, strict=True):
        torch.testing.assert_close(_full(p.grad), g * (0.5 / (expected + 1e-6)))


def test_mixed_clip_takes_one_collective_per_mesh(one_rank, counts):
    named = _params(one_rank)
    before = [_full(p.grad).clone() for _, p in named]
    expected = torch.cat([g.flatten() for g in before]).norm()
    counts.update(dict.fromkeys(counts, 0))
    total = grad_clip.clip_grad_norm_([p for _, p in named], max_norm=1e6)  # no clipping
    assert counts["full_tensor"] == 1 and counts["cpu"] == 0 and counts["item"] == 0
    torch.testing.assert_close(total, expected)
    for (_, p), g in zip(named, before, strict=True):
        torch.testing.assert_close(_full(p.grad), g)


@pytest.mark.parametrize("max_norm, match", [(-1.0, r"invalid max_norm=-1.0 \(must be >= 0"),
                                             (float("nan"), "invalid max_norm=nan")])
def test_every_clip_refuses_a_max_norm_that_would_ascend(one_rank, max_norm, match):
    # torch's clip scales by max_norm / norm, clamped above only: a negative max_norm flipped
    # every gradient's sign (gradient ascent) and NaN wiped them, both without a word
    named = _params(one_rank)
    before = [_full(p.grad).clone() for _, p in named]
    stage = types.SimpleNamespace(named_parameters=lambda: iter(named),
                                  _parts=types.SimpleNamespace(ties=[], pp_group=None))
    with pytest.raises(ValueError, match=match):
        grad_clip.clip_grad_norm_([p for _, p in named], max_norm)
    with pytest.raises(ValueError, match=match):
        Pipeline.clip_grad_norm_(stage, max_norm)
    for (_, p), g in zip(named, before, strict=True):
        assert torch.equal(_full(p.grad), g)
