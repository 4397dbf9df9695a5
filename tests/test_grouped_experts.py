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


def test_a_peer_major_arrival_lands_where_its_expert_major_rows_would():
    from parallel.nn.experts import block_slots

    blocks = [[2, 0, 1], [1, 3, 0]]  # peer 0: 2 rows for expert 0, 1 for expert 2; peer 1: ...
    per_expert = [3, 3, 1]
    # expert-major order: e0 <- p0 (2), p1 (1); e1 <- p1 (3); e2 <- p0 (1)
    expert_major = padded_slots(per_expert, 3).tolist()  # [0, 1, 2, 3, 4, 5, 6]
    # peer-major rows: p0e0 (2), p0e2 (1), p1e0 (1), p1e1 (3)
    assert block_slots(blocks, 3).tolist() == [expert_major[0], expert_major[1], expert_major[6],
                                               expert_major[2], expert_major[3], expert_major[4],
                                               expert_major[5]]


def test_experts_given_a_peer_major_arrival_return_it_in_that_order():
    torch.manual_seed(0)
    blocks = [[2, 0, 1], [1, 3, 0]]
    experts = GroupedExperts(8, 16, 3)
    rows = torch.randn(7, 8)
    peer_major = [(0, 0), (0, 0), (0, 2), (1, 0), (1, 1), (1, 1), (1, 1)]  # (peer, expert)
    order = sorted(range(7), key=lambda i: (peer_major[i][1], peer_major[i][0], i))
    want = torch.empty(7, 8)
    want[order] = experts(rows[order], [3, 3, 1])
    torch.testing.assert_close(experts(rows, [3, 3, 1], blocks=blocks), want)


def test_host_blocks_go_through_in_reused_size_slices_with_the_loop_s_numerics(monkeypatch):
    """On the host the padded block is cut so each hidden activation stays within
    ``HOST_REUSED_BLOCK_BYTES`` (the allocator's reused memory: larger ones are fresh pages
    faulted in on every step); the result and gradients are the loop's."""
    import foundation.device as hd

    monkeypatch.setattr(hd, "HOST_REUSED_BLOCK_BYTES", 3 * 16 * 4 * 4)  # 4 experts x 3 rows
    assert hd.rows_per_block(4 * 16 * 4, "cpu") == 3 and hd.rows_per_block(10**9, "cpu") == 1
    calls = {"bmm": 0}
    real_bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *a, **k: (calls.__setitem__("bmm", calls["bmm"] + 1),
                                                       real_bmm(*a, **k))[1])
    torch.manual_seed(0)
    counts = [3, 0, 8, 1]  # 8 padded rows: slices of 3, 3 and 2
    experts = GroupedExperts(8, 16, len(counts))
    tokens = torch.randn(sum(counts), 8, requires_grad=True)
    got = experts(tokens, counts)
    assert calls["bmm"] == 6
    got.square().sum().backward()
    grads = [t.grad.clone() for t in (tokens, experts.w1, experts.w2)]
    for t in (tokens, experts.w1, experts.w2):
        t.grad = None
    want = loop(experts, tokens, counts)
    want.square().sum().backward()
    torch.testing.assert_close(got, want)
    for g, t in zip(grads, (tokens, experts.w1, experts.w2), strict=True):
        torch.testing.assert_close(g, t.grad)
