"""Level3 on gloo without FSDP2 (``parallel/optimizer_parallel/resharded.py``), on 2 ranks.

What a user of ZeRO-3 relies on beyond "trains like one process": between steps no rank holds a
whole weight (their storage is released, only ``Shard(0)`` slices remain); during forward at most
the running unit and the one being prefetched are whole; a weight tied across two units, uneven
rows, gradient accumulation, activation recompute, an evaluation under ``no_grad`` and a
checkpoint written into the slices all work; a weight that shares its storage with another
tensor (whose release would free the other) is left to FSDP2.
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


class _Stack(nn.Module):
    """A root layer, three units (``layers``: the second's 5 rows split 3/2 over 2 ranks, the
    third's weight tied to the first's) and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(6, 12)
        self.layers = nn.ModuleList([
            nn.Sequential(nn.Linear(12, 12), nn.Tanh()),
            nn.Sequential(nn.Linear(12, 5), nn.Tanh(), nn.Linear(5, 12), nn.Tanh()),
            nn.Sequential(nn.Linear(12, 12), nn.Tanh())])
        self.layers[2][0].weight = self.layers[0][0].weight
        self.head = nn.Linear(12, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.embed(x))
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _batch(step: int) -> torch.Tensor:
    return torch.randn(8, 6, generator=torch.Generator().manual_seed(step))


def _whole_bytes(model: parallel.optimizer_parallel.ShardedDataParallel) -> list[int]:
    """Bytes of each unit's whole weights held now (the root's not counted)."""
    weights = model._whole
    return [sum(pair.whole.untyped_storage().nbytes() for pair in pairs)
            for pairs in weights.unit_pairs]


def _train(model: nn.Module, rank: int, world: int) -> tuple[list[float], dict]:
    """Three AdamW steps; the second accumulates two micro-batches (under ``no_sync`` where the
    model has it)."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses = []
    for step in range(3):
        batch = _batch(step)
        parts = batch.chunk(2) if step == 1 else [batch]
        total = 0.0
        for index, part in enumerate(parts):
            mine = part.chunk(world)[rank]
            loss = F.mse_loss(model(mine), mine) / len(parts)
            if index < len(parts) - 1 and hasattr(model, "no_sync"):
                with model.no_sync():
                    loss.backward()
            else:
                loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, full_params(model)


def _checks(rank: int, world: int) -> dict:
    parallel.init()
    out: dict = {}
    model = parallel.optimizer_parallel.ShardedDataParallel(_Stack(), "level3", threshold_kb=0)
    out["kind"] = type(model._whole).__name__
    seen: list[int] = []
    for layer in model.module.layers:  # how many units are whole while each one runs
        layer[0].register_forward_hook(
            lambda *_: seen.append(sum(1 for n in _whole_bytes(model) if n)))
    out["losses"], out["params"] = _train(model, rank, world)
    out["whole_in_forward"] = max(seen)
    out["released"] = all(pair.whole.untyped_storage().nbytes() == 0
                          for pair in model._whole.pairs)
    out["slices"] = all(isinstance(p, DTensor) for p in model.parameters())
    with torch.no_grad():
        out["eval"] = model.module(_batch(5))  # the inner model, as a recipe's evaluate does
    out["released_after_eval"] = all(pair.whole.untyped_storage().nbytes() == 0
                                     for pair in model._whole.pairs)
    with torch.no_grad():  # a "checkpoint load" into the slices: every rank writes its rows
        for p in model.parameters():
            p.to_local().fill_(0.125)
        out["loaded_forward"] = model(_batch(6))
    recomputed = _Stack()
    parallel.recompute(recomputed, "full")  # the whole model: units run again in backward
    recomputed = parallel.optimizer_parallel.ShardedDataParallel(recomputed, "level3",
                                                                 threshold_kb=0)
    out["recompute_losses"], out["recompute_params"] = _train(recomputed, rank, world)
    shared = _Stack()
    storage = torch.zeros(12 * 12 + 1)
    shared.embed.weight = nn.Parameter(storage[:72].view(12, 6))  # shares one storage
    shared.layers[0][0].bias = nn.Parameter(storage[72:84])
    out["shared_kind"] = type(parallel.optimizer_parallel.ShardedDataParallel(shared, "level3",
                                                                              threshold_kb=0)._whole).__name__
    parallel.destroy()
    return out


def _one_process() -> dict:
    model = _Stack()
    losses, params = _train(model, 0, 1)
    with torch.no_grad():
        evaluated = model(_batch(5))
        for p in model.parameters():
            p.fill_(0.125)
        loaded = model(_batch(6))
    return {"losses": losses, "params": params, "eval": evaluated, "loaded_forward": loaded}


@pytest.mark.slow
def test_level3_on_gloo_releases_whole_weights_and_trains_like_one_process():
    results = run_ranks(_checks, 2, timeout=180)
    ref = _one_process()
    for key in ("losses", "recompute_losses"):  # the ranks' halves of each batch, averaged
        mean = [sum(v) / len(v) for v in zip(*(r[key] for r in results), strict=True)]
        assert mean == pytest.approx(ref["losses"], rel=1e-5), key
    for got in results:
        assert got["kind"] == "ReshardedWeights" and got["shared_kind"] == "NoneType"
        assert got["released"] and got["slices"] and got["released_after_eval"]
        assert got["whole_in_forward"] <= 2  # the running unit and the next one's prefetch
        for params in (got["params"], got["recompute_params"]):
            assert params.keys() == ref["params"].keys()
            for name, value in ref["params"].items():
                torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(got["eval"], ref["eval"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["loaded_forward"], ref["loaded_forward"])
