"""MoE experts run as two batched matmuls, not a Python loop per expert (issue 24, finding 14),
with the loop's numerics: outputs and gradients equal within fp32 tolerance, for uneven, empty
and all-empty expert counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parallel.nn.experts import GroupedExperts, padded_slots


def loop(experts: GroupedExperts, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The reference: one matmul pair per expert."""
    outs = [F.gelu(chunk @ experts.w1[e]) @ experts.w2[e]
            for e, chunk in enumerate(tokens.split(counts)) if counts[e]]
    return torch.cat(outs)


def test_padded_slots_place_each_expert_s_rows_in_its_block():
    assert padded_slots([2, 0, 3], 3).tolist() == [0, 1, 6, 7, 8]
    assert padded_slots([1, 1], 1).tolist() == [0, 1]


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [4, 4, 4, 4], [0, 0, 7, 0], [1, 2, 3, 9]])
def test_batched_experts_equal_the_loop(counts):
    torch.manual_seed(0)
    experts = GroupedExperts(8, 16, len(counts))
    tokens = torch.randn(sum(counts), 8, requires_grad=True)
    got = experts(tokens, counts)
    got.square().sum().backward()
    grads = [t.grad.clone() for t in (tokens, experts.w1, experts.w2)]
    for t in (tokens, experts.w1, experts.w2):
        t.grad = None
    want = loop(experts, tokens, counts)
    want.square().sum().backward()
    torch.testing.assert_close(got, want)
    for g, t in zip(grads, (tokens, experts.w1, experts.w2), strict=True):
        torch.testing.assert_close(g, t.grad)


def test_experts_run_in_one_batched_matmul_per_layer(monkeypatch):
    calls = {"bmm": 0}
    real_bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *a, **k: (calls.__setitem__("bmm", calls["bmm"] + 1),
                                                       real_bmm(*a, **k))[1])
    experts = GroupedExperts(8, 16, 6)
    experts(torch.randn(12, 8), [2, 2, 2, 2, 2, 2])
    assert calls["bmm"] == 2


def test_no_rows_still_yield_an_empty_function_of_the_weights():
    experts = GroupedExperts(8, 16, 3)
    out = experts(torch.randn(0, 8, requires_grad=True), [0, 0, 0])
    assert out.shape == (0, 8) and out.requires_grad
