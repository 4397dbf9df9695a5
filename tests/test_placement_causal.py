"""The causal-mask rewrite (``hetero/placement/causal.py``): where export made HuggingFace's causal
mask explicit, the placed graph calls SDPA with ``is_causal=True`` (and ``enable_gqa``) as eager
does, with the unplaced model's outputs and gradients; a mask that reads an input (padding), a
buffer, or is a constant other than the causal one is left in the graph."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import hetero
from tests.zoo_models import ZOO

_SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _sdpa_calls(placed: nn.Module) -> list[fx.Node]:
    graphs = [m.graph for m in placed._last.runner.split_gm.modules()
              if isinstance(m, fx.GraphModule)]
    return [n for g in graphs for n in g.nodes if n.target is _SDPA]


def _mask(node: fx.Node) -> object:
    return node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")


def _targets(placed: nn.Module) -> set[str]:
    return {str(n.target) for m in placed._last.runner.split_gm.modules()
            if isinstance(m, fx.GraphModule) for n in m.graph.nodes}


def _placed_and_reference(family: str, embedding_on_cpu: bool = True
                          ) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = ZOO[family].build()
    reference = copy.deepcopy(model)
    if embedding_on_cpu:
        hetero.set_device(model.get_input_embeddings(), "cpu")
    return hetero.place(model), reference


def _assert_same(placed: nn.Module, reference: nn.Module, batch: dict) -> None:
    ours, theirs = placed(**batch), reference(**batch)
    torch.testing.assert_close(ours.logits, theirs.logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-5, atol=1e-6)
    ours.loss.backward()
    theirs.loss.backward()
    for (name, p), r in zip(placed.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("embedding_on_cpu", [False, True])
def test_the_causal_mask_becomes_is_causal_with_equal_outputs_and_gradients(family,
                                                                            embedding_on_cpu):
    placed, reference = _placed_and_reference(family, embedding_on_cpu)
    ids = torch.randint(0, 99, (3, 16), generator=torch.Generator().manual_seed(1))
    _assert_same(placed, reference, {"input_ids": ids, "labels": ids})
    calls = _sdpa_calls(placed)
    assert len(calls) == 2  # one per layer
    for node in calls:
        assert _mask(node) is None and node.kwargs["is_causal"] is True
        assert node.kwargs["enable_gqa"] is True  # keys/values no longer repeated (GQA 4:2)
    # the mask's construction (its packed-sequence check included) left the graph
    assert not {"aten.cumsum.default", "aten.index.Tensor", "aten.le.Tensor"} & _targets(placed)


def test_a_padding_mask_is_an_input_and_stays():
    placed, reference = _placed_and_reference("llama")
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 99, (3, 16), generator=gen)
    attention = torch.ones(3, 16, dtype=torch.long)
    attention[0, :5] = 0  # left padding
    _assert_same(placed, reference, {"input_ids": ids, "attention_mask": attention,
                                     "labels": ids})
    calls = _sdpa_calls(placed)
    assert calls and all(isinstance(_mask(n), fx.Node) for n in calls)
    assert not any(n.kwargs.get("is_causal") for n in calls)


def test_a_constant_mask_that_is_not_causal_stays():
    """Mistral's sliding window (8 of 16 positions) is built from constants too, but it is not
    the causal mask: its value decides, and the SDPA call keeps it."""
    placed, reference = _placed_and_reference("mistral")
    ids = torch.randint(0, 99, (2, 16), generator=torch.Generator().manual_seed(3))
    _assert_same(placed, reference, {"input_ids": ids, "labels": ids})
    calls = _sdpa_calls(placed)
    assert calls and all(isinstance(_mask(n), fx.Node) for n in calls)


def _tril(s: int, x: torch.Tensor) -> torch.Tensor:
    return torch.ones(s, s, dtype=torch.bool, device=x.device).tril()


_MASKS = {  # name: (mask from (module, length, input), rewritten?)
    "causal, built in forward": (lambda m, s, x: _tril(s, x), True),
    "causal, read from a buffer (may change between calls)": (
        lambda m, s, x: m.causal[:s, :s], False),
    "anti-causal constant": (lambda m, s, x: _tril(s, x).T, False),
}


class _Attention(nn.Module):
    """Self-attention with one of ``_MASKS``."""

    def __init__(self, mask: str, d: int = 16, length: int = 8) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mask = _MASKS[mask][0]
        self.register_buffer("causal", torch.ones(length, length, dtype=torch.bool).tril())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (t.view(b, s, 2, d // 2).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(self, s, x))
        return self.out(y.transpose(1, 2).reshape(b, s, d))


@pytest.mark.parametrize("mask", list(_MASKS))
def test_only_a_constant_causal_mask_is_rewritten(mask):
    torch.manual_seed(0)
    model = _Attention(mask)
    reference = copy.deepcopy(model)
    x = torch.randn(2, 8, 16, requires_grad=True)
    placed = hetero.place(model)
    ours, theirs = placed(x), reference(x)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    (call,) = _sdpa_calls(placed)
    rewritten = _MASKS[mask][1]
    assert (_mask(call) is None) is rewritten
    assert call.kwargs.get("is_causal", False) is rewritten
    assert "enable_gqa" not in call.kwargs  # no repeated heads here
    ours.sum().backward()
    grad = x.grad.clone()
    x.grad = None
    theirs.sum().backward()
    torch.testing.assert_close(grad, x.grad, rtol=1e-5, atol=1e-6)
