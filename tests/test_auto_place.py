"""auto_place on real models: budgets below the parameter bytes, and plans that never change the
numbers (the plan is applied through the same capture and runner as ``hetero.place``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hetero

transformers = pytest.importorskip("transformers")


def _gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32,
                                  bos_token_id=0, eos_token_id=0, use_cache=False,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def _train_alike(placed: nn.Module, reference: nn.Module, batches, forward) -> None:
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (placed, reference)]
    for batch in batches:
        losses = []
        for model, opt in zip((placed, reference), opts, strict=True):
            opt.zero_grad()
            loss = forward(model, batch)
            loss.backward()
            opt.step()
            losses.append(loss.detach().cpu())
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-5)
    for (name, p), (_, r) in zip(placed.named_parameters(), reference.named_parameters(),
                                 strict=True):
        torch.testing.assert_close(p.detach().cpu(), r.detach(), rtol=1e-4, atol=1e-5, msg=name)


def test_gpt2_under_a_budget_below_its_parameter_bytes_trains_like_unplaced():
    model = _gpt2()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 16))
    param_bytes = sum(p.nbytes for p in model.parameters())
    budget = param_bytes // 2
    placed = hetero.auto_place(model, (), example_kwargs={"input_ids": ids, "labels": ids},
                               device_memory_budget=budget)
    assert placed.plan.on("cpu"), hetero.explain(placed)
    assert f"<= budget {budget}" in hetero.explain(placed)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (2, 16), generator=gen) for _ in range(3)]
    _train_alike(placed, reference, batches,
                 lambda m, b: m(input_ids=b, labels=b).loss)
    # the floor: everything movable, down to (almost) nothing on the device
    floor = hetero.auto_place(_gpt2(), (), example_kwargs={"input_ids": ids, "labels": ids},
                              device_memory_budget=1024)
    assert "<= budget 1024" in hetero.explain(floor)


class Tower(nn.Module):
    def __init__(self, table: nn.EmbeddingBag, d: int = 16) -> None:
        super().__init__()
        self.table, self.norm = table, nn.BatchNorm1d(d)
        self.mlp = nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, 16))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.norm(self.table(ids)))


class DualTower(nn.Module):
    """User and item towers (one with an in-place renormalised table), batch norms updating
    running statistics in place, a dot-product score and its loss in the model's own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.user = Tower(nn.EmbeddingBag(4000, 16, mode="sum"))
        self.item = Tower(nn.EmbeddingBag(3000, 16, mode="mean", max_norm=1.0))

    def forward(self, users, items, clicks):
        score = (self.user(users) * self.item(items)).sum(-1)
        return nn.functional.binary_cross_entropy_with_logits(score, clicks)


@pytest.mark.parametrize("share", [1.0, 0.5, 0.05])
def test_dual_tower_plans_never_change_the_numbers(share):
    torch.manual_seed(0)
    model = DualTower()
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, 4000, (8, 3), generator=gen),
                torch.randint(0, 3000, (8, 3), generator=gen),
                torch.rand(8, generator=gen)) for _ in range(3)]
    budget = int(share * hetero.placement.device_footprint(model, batches[0]))
    placed = hetero.auto_place(model, batches[0], device_memory_budget=budget)
    _train_alike(placed, reference, batches, lambda m, b: m(*b))
    for (name, b), (_, r) in zip(placed.named_buffers(), reference.named_buffers(), strict=True):
        torch.testing.assert_close(b.cpu(), r, msg=name)
