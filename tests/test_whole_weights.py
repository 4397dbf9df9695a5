"""Level1 without FSDP2 (``parallel/optimizer_parallel/whole_weights.py``): whole weights for
forward and backward, ``Shard(0)`` slices for the optimizer, on 2 gloo ranks.

What a user relies on beyond "trains like one process" (``test_optimizer_parallel.py``): the
model shows ``Shard(0)`` DTensors at rest (its optimizer, state dict and clipping see slices);
a checkpoint loaded into the slices reaches the whole weights the next forward computes with;
an evaluation forward under ``no_grad`` leaves the slices registered; two backward passes without
``zero_grad`` add up; uneven and 0-dim parameters work; ties survive.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import parallel
from distributed import run_ranks
from pipeline_helpers import full_params


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 10)  # 10 rows: 5 per rank; the bias (10) too
        self.odd = nn.Linear(10, 3)  # 3 rows over 2 ranks: uneven
        self.scale = nn.Parameter(torch.tensor(1.5))  # 0-dim: stays replicated
        self.out = nn.Linear(3, 6, bias=False)
        self.tied = self.out  # a second registration of the same weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.odd(torch.tanh(self.inp(x))))) * self.scale


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(step))


def _checks(rank: int, world: int) -> dict:
    parallel.init()
    model = parallel.optimizer_parallel.ShardedDataParallel(_Net(), "level1", threshold_kb=0)
    out: dict = {"whole": model.keeps_whole_weights}
    at_rest = dict(model.named_parameters())
    out["rest_dtensors"] = sorted(n for n, p in at_rest.items() if isinstance(p, DTensor))
    out["tied"] = model.module.tied.weight is model.module.out.weight
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    mine = _batch(0).chunk(world)[rank]
    F.mse_loss(model(mine), mine).backward()  # two backward passes, no zero_grad between
    F.mse_loss(model(mine), mine).backward()
    out["grads"] = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
                    for n, p in model.named_parameters()}
    opt.step()
    opt.zero_grad()
    with torch.no_grad():  # evaluation through the inner model (not the wrapper), as a
        evaluated = model.module(_batch(1))  # recipe's evaluate does: the slices stay registered
    out["eval_rest"] = all(isinstance(p, DTensor) for n, p in model.named_parameters()
                           if n != "scale")
    out["eval"] = evaluated
    out["after_step"] = full_params(model)
    with torch.no_grad():  # a "checkpoint load" into the slices: every rank writes its rows
        for p in model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            local.fill_(0.25)
        out["loaded_forward"] = model(_batch(2))
    parallel.destroy()
    return out


def _one_process() -> dict:
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    whole = _batch(0)
    for _ in range(2):
        sum(F.mse_loss(model(part), part) for part in whole.chunk(2)).div(2).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    with torch.no_grad():
        evaluated = model(_batch(1))
        after = full_params(model)
        for p in model.parameters():
            p.fill_(0.25)
        loaded = model(_batch(2))
    return {"grads": grads, "eval": evaluated, "after_step": after, "loaded_forward": loaded}


@pytest.mark.slow
def test_level1_keeps_whole_weights_and_shows_slices():
    results = run_ranks(_checks, 2, timeout=180)
    ref = _one_process()
    for got in results:
        assert got["whole"] and got["tied"] and got["eval_rest"]
        assert got["rest_dtensors"] == ["inp.bias", "inp.weight", "odd.bias", "odd.weight",
                                        "out.weight"]
        for key in ("grads", "after_step"):
            assert got[key].keys() == ref[key].keys()
            for name in ref[key]:
                torch.testing.assert_close(got[key][name], ref[key][name], rtol=1e-5,
                                           atol=1e-6, msg=f"{key} {name}")
        torch.testing.assert_close(got["eval"], ref["eval"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["loaded_forward"], ref["loaded_forward"])
