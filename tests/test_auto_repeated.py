"""A repeated layer stack is captured once (``parallel/auto/repeated.py``): the graph and the
plans equal the full capture's, and models whose layers are not alike are captured whole."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import parallel
import parallel.auto.plan as plan_module
from parallel.auto import repeated
from parallel.auto.cost_model import DEFAULT_PROFILES
from parallel.auto.graph import _capture_all, capture_ops
from recipes.gpt import GPT


def _gpt(layers: int = 6) -> nn.Module:
    with torch.device("meta"):
        return GPT(65, 64, layers, 4, 32)


IDX = torch.zeros(8, 32, dtype=torch.long)


def _counted(calls: list[int]):
    def capture(model, inputs):
        calls.append(len(model.blocks))
        return _capture_all(model, inputs)
    return capture


@pytest.mark.parametrize("layers", [4, 6, 9])
def test_the_graph_from_three_layers_equals_the_full_capture(layers):
    model = _gpt(layers)
    calls: list[int] = []
    reused = repeated.capture_repeated(model, (IDX,), _counted(calls))
    assert calls == [repeated.CAPTURED]  # one capture, three layers deep
    assert len(model.blocks) == layers  # the model is given back whole
    assert reused == capture_ops(model, (IDX,), reuse=False)


@pytest.mark.parametrize("mode", ["sharding_propagation", "dynamic_programming",
                                  "recursive_programming"])
def test_the_plan_with_reuse_equals_the_plan_without(mode, monkeypatch):
    model = _gpt(6)
    strategies = {"blocks.*.mlp.0": ((1, 1, 1), (4, 1))} if mode == "sharding_propagation" \
        else None
    kwargs = dict(device_num=4, search_mode=mode, profile=DEFAULT_PROFILES["device"],
                  strategies=strategies)
    reused = parallel.plan_auto_parallel(model, (IDX,), **kwargs)
    monkeypatch.setattr(plan_module, "capture_ops",
                        lambda m, x: capture_ops(m, x, reuse=False))
    whole = parallel.plan_auto_parallel(model, (IDX,), **kwargs)
    assert reused.by_op == whole.by_op and reused.strategies == whole.strategies
    assert reused.cost == pytest.approx(whole.cost)


def test_layers_annotated_differently_are_captured_whole():
    model = _gpt(5)
    parallel.shard(model.blocks[3].mlp[0], ((1, 1, 1), (2, 1)))
    assert repeated.repeated_stack(model) is None
    calls: list[int] = []
    repeated.capture_repeated(model, (IDX,), _counted(calls))
    assert calls == [5]


class _Dense(nn.Module):
    """Every layer reads the sum of all earlier outputs: layer 2 is not layer 1 moved."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(5))

    def forward(self, x):
        seen = [x]
        for layer in self.layers:
            seen.append(layer(sum(seen)))
        return seen[-1]


class _Counted(nn.Module):
    """A forward that needs every layer."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(5))

    def forward(self, x):
        if len(self.layers) != 5:
            raise RuntimeError("five layers expected")
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


@pytest.mark.parametrize("make", [_Dense, _Counted])
def test_stacks_that_do_not_repeat_fall_back_to_the_full_capture(make):
    with torch.device("meta"):
        model = make()
    x = torch.zeros(4, 16)
    calls: list[int] = []

    def capture(m, inputs):
        calls.append(len(m.layers))
        return _capture_all(m, inputs)
    got = repeated.capture_repeated(model, (x,), capture)
    assert calls[-1] == 5 and got == _capture_all(model, (x,))


def test_a_huggingface_llama_stack_is_reused():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=5, num_attention_heads=4,
                                      num_key_value_heads=4, use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    x = torch.zeros(2, 16, dtype=torch.long)
    calls: list[int] = []

    def capture(m, inputs):
        calls.append(len(m.model.layers))
        return _capture_all(m, inputs)
    got = repeated.capture_repeated(model, (x,), capture)
    assert got == _capture_all(model, (x,))
    assert calls == [repeated.CAPTURED]
