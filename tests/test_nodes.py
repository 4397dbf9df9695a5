"""Node-aware layouts: which node each rank is on (torchrun's LOCAL_WORLD_SIZE), which of the
world mesh's groups stay inside a node, and the warning (or, with ``strict_nodes``, the refusal)
for a tensor or expert group that crosses nodes."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

import parallel
from distributed import run_ranks
from parallel import ParallelConfig
from parallel.dims import WORLD_DIMS
from parallel.nodes import Nodes, describe, job_nodes, nodes_spanned, spanning_problems
from parallel.semi_auto import load_strategy_file
from recipes.gpt import GPT

STRATEGY = "conf/strategy/gpt_megatron.yaml"


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    return GPT(37, d_model=16, n_layer=1, n_head=4, block_size=8, dropout=0.0)


def _megatron(tensor: int, **fields) -> ParallelConfig:
    return ParallelConfig(tensor_degree=tensor, strategies=load_strategy_file(
        STRATEGY, dp=4 // tensor, mp=tensor), **fields)


def test_the_nodes_come_from_torchruns_local_world_size(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert job_nodes(8) == Nodes(size=4, count=2)
    assert job_nodes(8).node_of(5) == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert job_nodes(8) == Nodes(size=8, count=1)  # a plain process: one node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # agents of different sizes: boundaries unknown
    assert job_nodes(8) == Nodes(size=8, count=1)


@pytest.mark.parametrize("shape, nodes, spans", [
    ((1, 2, 1, 1, 4), 4, {"dp": 2, "tp": 1}),  # Megatron's placement: tensor inside, data across
    ((2, 1, 1, 1, 4), 4, {"pp": 2, "tp": 1}),
    ((1, 1, 1, 1, 8), 4, {"tp": 2}),  # tensor degree larger than a node
    ((1, 2, 2, 1, 2), 4, {"dp": 2, "ep": 1, "tp": 1}),  # ep × tp = 4 ranks: one node
    ((1, 1, 4, 1, 2), 4, {"ep": 2, "tp": 1}),  # ep × tp = 8 ranks: two nodes
    ((2, 2, 1, 1, 2), 2, {"pp": 2, "dp": 2, "tp": 1}),
    ((1, 2, 1, 2, 2), 4, {"dp": 2, "cp": 1, "tp": 1}),  # cp × tp = 4 ranks: one node
    ((1, 1, 1, 4, 2), 4, {"cp": 2, "tp": 1}),  # cp × tp = 8 ranks: two nodes
])
def test_which_groups_cross_nodes(shape, nodes, spans):
    layout = Nodes(nodes, 8 // nodes)
    got = {name: nodes_spanned(shape, i, layout) for i, name in enumerate(WORLD_DIMS)
           if shape[i] > 1}
    assert got == spans


def test_a_tensor_group_across_nodes_is_named_with_a_layout_that_fits():
    problems = spanning_problems((1, 1, 1, 1, 8), WORLD_DIMS, Nodes(4, 2))
    assert len(problems) == 1
    assert "tensor_degree=8 spans 2 nodes of 4 ranks" in problems[0]
    assert "tensor_degree=4, the other 2× on data_degree or pipeline_degree" in problems[0]
    experts = spanning_problems((1, 1, 4, 1, 2), WORLD_DIMS, Nodes(4, 2))
    assert len(experts) == 1 and "expert_degree=4 × tensor_degree=2 = 8 ranks span 2 nodes" in \
        experts[0] and "expert_degree=2 keeps it inside a node" in experts[0]
    context = spanning_problems((1, 1, 1, 4, 2), WORLD_DIMS, Nodes(4, 2))
    assert len(context) == 1 and "context_degree=4 × tensor_degree=2 = 8 ranks span 2 nodes" \
        in context[0] and "context_degree=2 keeps them inside a node" in context[0]
    assert spanning_problems((2, 2, 1, 1, 2), WORLD_DIMS, Nodes(4, 2)) == []
    assert describe((2, 2, 1, 1, 2), WORLD_DIMS, Nodes(2, 4)) == \
        "4 nodes × 2 ranks; inside a node: tp; across nodes: pp (2 nodes), dp (2 nodes)"
    assert describe((1, 4, 1, 1, 1), WORLD_DIMS, Nodes(4, 1)) == "1 node of 4 ranks"


def test_strict_nodes_is_a_config_field_checked_by_name():
    assert ParallelConfig(strict_nodes=True).strict_nodes
    with pytest.raises(TypeError, match="strict_nodes"):
        ParallelConfig(strict_nodes="yes")


def _two_nodes_of_two(rank: int, world: int) -> dict:
    """4 ranks seen as 2 nodes of 2 (torchrun's two agents of 2 workers): a tensor degree of 2
    stays inside a node, of 4 crosses; ``strict_nodes`` refuses the latter before any change."""
    before = os.environ["LOCAL_WORLD_SIZE"]
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        parallel.init()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            inside = parallel.parallelize(_gpt(), _megatron(2))
            fitting = [str(w.message) for w in caught]
            across = parallel.parallelize(_gpt(), _megatron(4))
        model = _gpt()
        before_state = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            parallel.parallelize(model, _megatron(4, strict_nodes=True))
            refused = ""
        except ValueError as error:
            refused = str(error)
        return {"inside": inside.explain().splitlines()[0],
                "across": across.explain().splitlines()[0],
                "fitting_warnings": fitting,
                "warnings": [str(w.message) for w in caught],
                "refused": refused, "unchanged": all(
                    type(v) is torch.Tensor and torch.equal(v, before_state[k])
                    for k, v in model.state_dict().items())}
    finally:
        os.environ["LOCAL_WORLD_SIZE"] = before


@pytest.mark.slow
def test_layouts_on_two_nodes_say_where_their_groups_run():
    results = run_ranks(_two_nodes_of_two, 4)
    first = results[0]
    assert first["inside"].endswith(
        "2 nodes × 2 ranks; inside a node: tp; across nodes: dp (2 nodes)")
    assert first["across"].endswith("2 nodes × 2 ranks; inside a node: none; "
                                    "across nodes: tp (2 nodes)")
    assert any("tensor_degree=4 spans 2 nodes of 2 ranks" in w for w in first["warnings"])
    assert not any("spans" in w for w in first["fitting_warnings"])
    assert first["refused"].startswith("ParallelConfig(strict_nodes=True): tensor_degree=4 "
                                       "spans 2 nodes")
    assert all(r["unchanged"] for r in results)
