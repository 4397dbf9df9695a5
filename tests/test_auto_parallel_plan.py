"""Sharding propagation planned without a process group: the reference's worked example on 8
devices, Megatron's row-parallel outputs propagated from column-parallel MLP inputs of the recipe
GPT, data parallel where no annotation reaches, plan files, and bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import parallel
from parallel.auto.plan import load_plan, plan_auto_parallel
from recipes.gpt import GPT


class ReferenceMLP(nn.Module):
    """MindSpore's example: MatMul1 (annotated) -> BiasAdd -> ReLU -> MatMul2, at a size where
    bytes rather than latency decide (planning holds no memory: fake tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(1024, 4096))
        self.b = nn.Parameter(torch.empty(4096))
        self.v = nn.Parameter(torch.empty(4096, 1024))
        self.matmul1 = parallel.shard(torch.matmul, ((2, 1), (1, 4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(torch.relu(self.matmul1(x, self.w) + self.b), self.v)


def test_the_reference_example_propagates_to_the_documented_strategies():
    plan = plan_auto_parallel(ReferenceMLP(), (torch.empty(8192, 1024),), device_num=8)
    assert plan.by_op == {"matmul": ((2, 1), (1, 4)), "add": ((2, 4), (4,)),
                          "relu": ((2, 4),), "matmul_1": ((2, 4), (4, 1))}
    assert [op.how for op in plan.ops] == ["annotated", "propagated", "propagated",
                                           "propagated"]
    assert plan.strategies == {"matmul1": ((2, 1), (1, 4))}
    # no redistribution between them; the parameters, used on batch halves, have their
    # gradients all-reduced over the 2 batch slices in backward; the result leaves whole: its
    # partial sums all-reduced over 4 (the reference's one AllReduce after MatMul2), its batch
    # halves gathered (and the gradient scattered back in backward)
    assert [(op.name, [(c.kind, c.group) for c in op.comms]) for op in plan.ops] == [
        ("matmul", [("all_reduce", 2)]), ("add", [("all_reduce", 2)]), ("relu", []),
        ("matmul_1", [("all_reduce", 2), ("all_reduce", 4), ("all_gather", 2),
                      ("reduce_scatter", 2)])]
    assert plan.cost > 0 and set(plan.breakdown) == set(plan.by_op)


def test_column_parallel_mlp_inputs_propagate_megatron_row_parallel_outputs():
    torch.manual_seed(0)
    model = GPT(65, 192, 4, 6, 64)
    annotated = {f"blocks.{i}.mlp.0": ((1, 1, 1), (2, 1)) for i in range(4)}
    plan = plan_auto_parallel(model, (torch.randint(0, 65, (16, 64)),), device_num=2,
                              strategies=annotated)
    for i in range(4):
        assert plan.strategies[f"blocks.{i}.mlp.1"] == ((1, 1, 2),)
        assert plan.strategies[f"blocks.{i}.mlp.2"] == ((1, 1, 2), (1, 2))  # row parallel
    comms = [c for op in plan.ops for c in op.comms]
    block_output = 16 * 64 * 192 * 4
    # the row-parallel outputs' partial sums, the column-parallel inputs' partial gradients
    # (Megatron's f and g: one all-reduce each way per layer), and the backward reductions of
    # the biases the row Linears add on each rank's partial product
    assert [(c.kind, c.group, c.bytes, c.backward) for c in comms if c.bytes > 192 * 4] == [
        ("all_reduce", 2, block_output, True), ("all_reduce", 2, block_output, False)] * 4
    assert all(c.bytes == 192 * 4 for c in comms if c.bytes <= 192 * 4)
    text = plan.explain()
    assert "annotated" in text and "all_reduce over 2" in text


def test_operators_no_annotation_reaches_are_data_parallel():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    plan = plan_auto_parallel(model, (torch.randn(32, 8),), device_num=4)
    assert plan.strategies == {"0": ((4, 1), (1, 1)), "1": ((4, 1),), "2": ((4, 1), (1, 1))}
    assert {op.how for op in plan.ops} == {"data parallel"}


def test_a_plan_saves_as_a_strategy_file_and_loads_back(tmp_path):
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024))
    plan = plan_auto_parallel(model, (torch.empty(4096, 1024),), device_num=2,
                              strategies={"0": ((1, 1), (2, 1))})
    path = plan.save(tmp_path / "plan.yaml")
    assert load_plan(path) == plan.strategies
    assert plan.strategies["2"] == ((1, 2), (1, 2))


@pytest.mark.parametrize("kwargs, match", [
    (dict(device_num=6), "device_num must be a power of two"),
    (dict(device_num=2, search_mode="greedy"), "search_mode 'greedy' is not one of"),
    (dict(device_num=2, strategies={"nope": ((1, 1), (2, 1))}), "'nope' matches no module"),
])
def test_bad_planning_input_is_refused_by_name(kwargs, match):
    model = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(ValueError, match=match):
        plan_auto_parallel(model, (torch.randn(2, 8),), **kwargs)


def test_an_annotation_on_a_module_without_a_rule_is_refused():
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8)))
    with pytest.raises(ValueError, match="'0' \\(Sequential\\) has no sharding rule"):
        plan_auto_parallel(model, (torch.randn(2, 8),), device_num=2,
                           strategies={"0": ((1, 1),)})


def test_planning_leaves_the_model_untagged():
    from parallel.semi_auto.shard import module_tag
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    plan_auto_parallel(model, (torch.randn(4, 8),), device_num=2,
                       strategies={"0": ((1, 1), (2, 1))})
    assert all(module_tag(m) is None for m in model)


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx))


def test_conflicting_annotations_on_a_shared_parameter_name_both_operators():
    with pytest.raises(ValueError, match="shared by operators 'embedding' \\(emb\\) and "
                                         "'linear' \\(head\\)"):
        plan_auto_parallel(TiedLM(), (torch.randint(0, 16, (4, 3)),), device_num=2,
                           strategies={"emb": ((1, 1), (1, 2)), "head": ((1, 1, 1), (2, 1))})


def test_a_shared_parameter_gets_one_layout():
    plan = plan_auto_parallel(TiedLM(), (torch.randint(0, 16, (4, 3)),), device_num=2,
                              strategies={"emb": ((1, 1), (1, 2))})
    assert plan.strategies["head"][1] == (1, 2)  # the table as the embedding holds it


@pytest.mark.parametrize("d, tokens", [(16, 32), (1024, 8192)])
def test_the_reference_ffn_of_linear_modules_propagates_without_redistribution(d, tokens):
    """fc1 annotated ((2, 1), (4, 1)) on 8 devices: fc2 meets fc1's output as it is, the
    row-parallel ((2, 4), (1, 4)), at any size (its own partial-sum reduction is not a
    redistribution; before, small sizes planned it replicated behind two all-gathers)."""
    class FFN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.act, self.fc2 = nn.Linear(d, 4 * d), nn.ReLU(), nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(self.act(self.fc1(x)))

    with torch.device("meta"):
        model, x = FFN(), torch.empty(tokens, d)
    plan = plan_auto_parallel(model, (x,), device_num=8, strategies={"fc1": ((2, 1), (4, 1))})
    assert plan.strategies == {"fc1": ((2, 1), (4, 1)), "act": ((2, 4),),
                               "fc2": ((2, 4), (1, 4))}
