"""``parallel.nn.MoE`` on one device: routing, capacity, the balancing loss and bias, against a
token-by-token reference written from the definitions."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from parallel.nn import MoE
from parallel.nn.router import capacity


def _reference(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Each token through its top-k experts, one at a time; choices beyond an expert's capacity
    (first choices before second ones, earlier tokens first) contribute nothing."""
    tokens = x.reshape(-1, x.shape[-1])
    probs = F.softmax(tokens @ moe.router.gate.weight.t(), dim=-1)
    choose = probs if moe.router.bias is None else probs + moe.router.bias
    top = choose.topk(moe.top_k, dim=-1).indices
    cap = math.inf if moe.dropless else math.ceil(
        moe.top_k * len(tokens) * moe.capacity_factor / moe.num_experts)
    taken = [0] * moe.num_experts
    keep = torch.zeros_like(top, dtype=torch.bool)
    for j in range(moe.top_k):
        for i in range(len(tokens)):
            e = int(top[i, j])
            if taken[e] < cap:
                taken[e] += 1
                keep[i, j] = True
    out = torch.zeros_like(tokens)
    w1, w2 = moe.experts.w1, moe.experts.w2
    for i, token in enumerate(tokens):
        weights = probs[i, top[i]]
        if moe.top_k > 1:
            weights = weights / weights.sum()
        for j in range(moe.top_k):
            if keep[i, j]:
                e = int(top[i, j])
                out[i] += weights[j] * (F.gelu(token @ w1[e]) @ w2[e])
    return out.reshape(x.shape), int((~keep).sum())


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("dropless", [False, True])
def test_forward_and_gradients_equal_the_token_by_token_reference(top_k, dropless):
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, top_k=top_k, capacity_factor=1.0, dropless=dropless)
    x = torch.randn(3, 7, 8, requires_grad=True)
    got = moe(x)
    want, dropped = _reference(moe, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert moe.dropped == dropped
    assert dropped == 0 if dropless else dropped > 0  # capacity 1.0 drops some here
    grads = torch.autograd.grad(got.square().sum(), [x, *moe.parameters()])
    want_grads = torch.autograd.grad(want.square().sum(), [x, *moe.parameters()])
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_dropped_choices_follow_the_capacity_formula():
    """Every token prefers expert 0: it takes capacity = ceil(k·tokens·factor/E) of them."""
    moe = MoE(4, 8, 4, top_k=1, capacity_factor=1.1)
    with torch.no_grad():
        moe.router.gate.weight.zero_()
        moe.router.gate.weight[0] = 1.0
    x = torch.ones(40, 4)
    moe(x)
    cap = capacity(40, 1, 4, 1.1)
    assert cap == math.ceil(1 * 40 * 1.1 / 4) == 11
    assert moe.dropped == 40 - cap and moe.load.tolist() == [40, 0, 0, 0]


def test_the_aux_loss_is_the_switch_balancing_loss():
    torch.manual_seed(1)
    moe = MoE(8, 16, 4, top_k=2, aux_loss_factor=0.05)
    x = torch.randn(32, 8)
    moe(x)
    probs = F.softmax(x @ moe.router.gate.weight.t(), dim=-1)
    chosen = probs.topk(2, dim=-1).indices
    fraction = torch.bincount(chosen.reshape(-1), minlength=4).float() / chosen.numel()
    want = 0.05 * 4 * (fraction * probs.mean(0)).sum()
    torch.testing.assert_close(moe.aux_loss, want)
    (gate_grad,) = torch.autograd.grad(moe.aux_loss, [moe.router.gate.weight])
    assert gate_grad.abs().sum() > 0  # it trains the router


def test_the_balancing_bias_steers_choices_but_not_weights():
    moe = MoE(4, 8, 2, top_k=1, balance_bias=True)
    with torch.no_grad():
        moe.router.gate.weight.zero_()
        moe.router.gate.weight[0, 0] = 1.0  # expert 0 preferred by a little
    x = torch.full((10, 4), 0.1)
    moe(x)
    assert moe.load.tolist() == [10, 0]
    for _ in range(200):
        moe.update_balance(rate=1e-3)
    moe(x)
    assert moe.load.tolist() == [0, 10]  # the bias moved everyone to the idle expert
    assert not moe.router.bias.requires_grad
    want, _ = _reference(moe, x)  # chosen with the bias, weighted by the unbiased scores
    torch.testing.assert_close(moe(x), want, rtol=1e-5, atol=1e-6)
    assert MoE(4, 8, 2).router.bias is None


@pytest.mark.parametrize("kwargs, match", [
    (dict(top_k=5), "top_k=5 exceeds num_experts=4"),
    (dict(capacity_factor=0.0), "capacity_factor must be > 0"),
    (dict(aux_loss_factor=-1.0), "aux_loss_factor must be >= 0"),
    (dict(router="sinkhorn"), "router 'sinkhorn' is not one of"),
    (dict(top_k=0), "top_k must be a positive int"),
])
def test_impossible_settings_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoE(8, 16, 4, **kwargs)


def test_a_trained_moe_dropped_with_a_wrapper_hooking_its_graph_is_freed():
    # a wrapper hooks the forward's graph and its hook holds the model (FSDP2's pre-backward
    # hooks hold its state, the state the model and its process groups): the aux_loss the
    # layer keeps must not hold that graph after backward, or the cycle runs through
    # autograd's C++ nodes, which the collector cannot follow, and the model is never freed
    import gc
    import weakref

    from torch import nn

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(8, 8)
            self.moe = MoE(8, 16, num_experts=4, top_k=2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            h.register_hook(lambda g: g if self.training else g)  # the wrapper's hook: holds self
            return self.moe(h)

    model = Wrapped()
    out = model(torch.randn(6, 8))
    (out.square().mean() + model.moe.aux_loss).backward()
    assert model.moe.aux_loss.grad_fn is None and model.moe.aux_loss.item() > 0  # kept, detached
    alive = weakref.ref(model)
    del model, out
    gc.collect()
    assert alive() is None


def test_a_moe_model_trained_under_activation_recompute_is_freed_when_dropped():
    # recompute runs each block's forward again inside backward: the balancing loss computed
    # there is part of no loss, so no gradient lets its graph go, and held by the layer it kept
    # the model alive (a cycle through autograd's nodes and the checkpoint's recompute closure)
    import gc
    import weakref

    import parallel
    from recipes.gpt import GPT

    torch.manual_seed(0)
    model = GPT(37, d_model=16, n_layer=2, n_head=2, block_size=8, dropout=0.0,
                moe=dict(num_experts=4, top_k=2, aux_loss_factor=0.05), moe_every=1)
    for block in model.blocks:
        parallel.recompute(block)
    x = torch.randint(0, 37, (4, 8))
    logits, loss = model(x, torch.roll(x, -1, dims=1))
    loss.backward()
    layers = [block.mlp for block in model.blocks]
    assert all(m.aux_loss.grad_fn is None and m.aux_loss.item() > 0 for m in layers)
    alive = weakref.ref(model)
    del model, layers, logits, loss
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("capacity_factor", [1.0, None])
def test_the_token_plan_reads_the_device_once(capacity_factor, monkeypatch):
    """The exchanges' split sizes must reach the host, and only the count table does, in one
    copy: with the choices on the meta device standing in for an accelerator (a meta tensor
    cannot be read), the one copy to the host is given the real table and every other value
    comes from it (before: three more reads of the device per layer, each a drain of its
    stream). The plan equals the one made on the host."""
    import foundation.device as hd
    from parallel.nn import token_plan

    torch.manual_seed(0)
    experts = torch.randint(0, 4, (21, 2))
    want = token_plan.plan_tokens(experts, 4, capacity_factor, copies=2)
    table = torch.stack([F.one_hot(experts[lo:hi], 4).sum(0)
                         for lo, hi in token_plan.copy_bounds(21, 2)], dim=1).unsqueeze(0)
    reads = []
    real_copy = hd.copy_to

    def copy_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        if tensor.device.type == "meta" and device.type == "cpu":
            reads.append(tuple(tensor.shape))
            return table  # what the device holds
        return real_copy(tensor, device)
    monkeypatch.setattr(hd, "copy_to", copy_to)
    got = token_plan.plan_tokens(experts.to("meta"), 4, capacity_factor, copies=2)
    assert reads == [(1, 2, 2, 4)]  # [ranks, k, copies, E], once
    assert (got.kept_counts, got.tokens, got.dropped) == (want.kept_counts, want.tokens,
                                                          want.dropped)
    assert got.kept.device.type == "meta" and got.kept.shape == want.kept.shape
