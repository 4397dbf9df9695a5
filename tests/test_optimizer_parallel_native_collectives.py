"""Optimizer parallel level1/2 where the group's collectives are native (NCCL, HCCL): FSDP2's
units, whose gradients are reduce-scattered (not all-reduced: twice ZeRO-2's bytes) and whose
weights are gathered unit by unit (``parallel/optimizer_parallel/backends.py``).

No NCCL here: the group's backend is asked through ``foundation.device.gathers_chunkwise``, and
these tests answer it as NCCL would, so the gloo ranks run the accelerators' path. They check the
bytes each collective moves in a step and the training against one process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import foundation.device as hd
import parallel
from distributed import run_ranks
from pipeline_helpers import full_params

pytestmark = pytest.mark.slow


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh())
                                    for _ in range(3))
        self.odd = nn.Linear(16, 3)  # 3 rows over 2 ranks: uneven
        self.scale = nn.Parameter(torch.tensor(1.5))  # 0-dim: FSDP2 refuses it; replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.odd(x) * self.scale


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 3, generator=g)


@contextlib.contextmanager
def _counted(moved: dict[str, int]) -> Iterator[None]:
    """Count the input bytes every all-reduce and reduce-scatter moves (FSDP2 calls
    ``reduce_scatter_single`` on torch 2.13, ``reduce_scatter_tensor`` before)."""
    names = {"all_reduce": "all_reduce", "reduce_scatter_single": "reduce_scatter",
             "reduce_scatter_tensor": "reduce_scatter"}
    with contextlib.ExitStack() as stack:
        for name, kind in names.items():
            original = getattr(dist, name, None)
            if original is None:
                continue

            def counting(*args, _original=original, _kind=kind, _name=name, **kwargs):
                tensor = kwargs.get("tensor", kwargs.get("input", kwargs.get("input_tensor")))
                if tensor is None:
                    tensor = args[0] if _name == "all_reduce" else args[1]
                if tensor.layout == torch.strided:
                    moved[_kind] += tensor.numel() * tensor.element_size()
                return _original(*args, **kwargs)
            stack.enter_context(mock.patch.object(dist, name, counting))
        yield


def _train(rank: int, world: int, level: str) -> dict:
    with mock.patch.object(hd, "gathers_chunkwise", lambda backend: False):  # NCCL's answer
        parallel.init()
        model = parallel.optimizer_parallel.ShardedDataParallel(_Net(), level, threshold_kb=0)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        sharded = sum(p.numel() * 4 for n, p in model.named_parameters() if n != "scale")
        losses, moved = [], {"all_reduce": 0, "reduce_scatter": 0}
        for step in range(3):
            x, y = (t.chunk(world)[rank] for t in _batch(step))
            with _counted(moved) if step == 2 else contextlib.nullcontext():
                loss = F.mse_loss(model(x), y)
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(parallel.collectives.all_reduce(loss.detach(), op="mean").item())
        out = {"losses": losses, "params": full_params(model), "moved": moved,
               "sharded_bytes": sharded, "backend": type(model.module.blocks[0]).__name__}
        parallel.destroy()
    return out


def _one_process() -> dict:
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses = []
    for step in range(3):
        x, y = _batch(step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone()
                                         for n, p in model.named_parameters()}}


@pytest.mark.parametrize("level", ["level1", "level2"])
def test_level1_and_2_reduce_scatter_gradients_on_native_collectives(level):
    ref = _one_process()
    for got in run_ranks(_train, 2, level, timeout=180):
        assert got["backend"].startswith("FSDP")  # every block an FSDP2 unit
        # every sharded gradient reduce-scattered; only the 0-dim scale is all-reduced
        assert got["moved"]["reduce_scatter"] >= got["sharded_bytes"]
        assert got["moved"]["all_reduce"] <= 64, got["moved"]
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-6, atol=0)
        for name, value in ref["params"].items():
            torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-6,
                                       msg=name)
