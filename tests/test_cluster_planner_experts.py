"""The cluster planner on mixtures of experts: the experts read from the graph, the expert
degree chosen and priced (the experts' bytes over ``e`` ranks, the token exchange by where the
expert group sits), and the plan's config (no process is spawned)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from parallel.auto import ClusterSpec, TransformerShape, expert_price
from parallel.auto.cluster_planner import (  # the package's plan_cluster is also a module
    plan_cluster,
    price_cluster_plan,
)
from parallel.auto.transformer_shape import shape_of
from recipes.gpt import GPT

A100 = ClusterSpec.preset("a100-80gb")
#: Mixtral 8x7B's sizes (the model card: 46.7 B parameters, 12.9 B used per token)
MIXTRAL = TransformerShape(32, 4096, 32, 4096, 32000, ffn=14336, kv_heads=8, gated=True,
                           tied=False, experts=8, top_k=2)


def _ids(seq: int = 64) -> tuple[torch.Tensor]:
    return (torch.zeros(1, seq, dtype=torch.long, device="meta"),)


@pytest.mark.parametrize("every", [1, 2])
def test_the_recipe_moe_gpt_reads_its_experts_from_the_graph(every):
    with torch.device("meta"):
        model = GPT(1000, 256, 4, 8, block_size=64, moe_every=every,
                    moe=dict(num_experts=8, top_k=2, dropless=True))
    assert shape_of(model, _ids()) == TransformerShape(
        4, 256, 8, 64, 1000, ffn=1024, experts=8, top_k=2, moe_layers=0 if every == 1 else 2)


def test_an_hf_mixtral_reads_its_experts_from_the_graph():
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=4, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=128)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert shape_of(model, _ids()) == TransformerShape(
        3, 256, 8, 64, 1000, ffn=512, kv_heads=4, gated=True, tied=False, experts=4, top_k=2)


class _ArgmaxExperts(nn.Module):
    """A decoder layer whose MLP is stacked experts chosen by argmax: no top-k the planner
    could read."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 64)
        self.qkv = nn.Linear(64, 192)
        self.router = nn.Linear(64, 4)
        self.w = nn.Parameter(torch.zeros(4, 64, 256))
        self.v = nn.Parameter(torch.zeros(4, 256, 64))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        q, k, v = self.qkv(x).view(1, -1, 3, 4, 16).permute(2, 0, 3, 1, 4)
        x = x + nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        choice = self.router(x).argmax(-1).flatten()[:1]  # a tensor: no data-dependent size
        w, v = self.w.index_select(0, choice)[0], self.v.index_select(0, choice)[0]
        return x + torch.relu(x @ w) @ v


def test_stacked_experts_without_a_top_k_choice_are_refused_naming_it():
    with torch.device("meta"):
        model = _ArgmaxExperts()
    with pytest.raises(ValueError, match="stacked expert weights \\(4 experts\\) but no top-k"):
        shape_of(model, _ids())


def test_an_moe_shape_counts_every_expert_and_the_experts_a_token_uses():
    assert MIXTRAL.params / 1e9 == pytest.approx(46.7, abs=0.05)
    used = MIXTRAL.layers * MIXTRAL.matmul_params + 2 * 32000 * 4096
    assert used / 1e9 == pytest.approx(12.9, abs=0.05)
    half = dataclasses.replace(MIXTRAL, moe_layers=16)
    assert half.expert_params == MIXTRAL.expert_params / 2


def test_expert_parallel_keeps_one_eth_of_the_experts_and_prices_the_exchange_by_placement():
    cluster = A100.with_nodes(8)

    def given(**layout):
        return price_cluster_plan(cluster=cluster, global_batch=512, shape=MIXTRAL,
                                  recompute="selective", **layout)
    whole, sharded = given(tensor=1, pipeline=8), given(tensor=1, pipeline=8, expert=8)
    assert not whole.fits and sharded.fits
    experts_per_rank = MIXTRAL.expert_params / 8
    # weights 2 + gradients 4 + Adam 12 bytes for each expert parameter a rank no longer holds
    assert whole.memory - sharded.memory == pytest.approx(
        18 * experts_per_rank * 7 / 8, rel=1e-6)
    assert "experts" in sharded.breakdown and "experts" not in whole.breakdown
    # the same expert degree inside a node (ranks 1 apart) or across two (2 apart, tensor 2)
    inside = dataclasses.replace(sharded.layout, micro_batch_size=1)
    across = dataclasses.replace(inside, tensor=2, data=inside.data // 2)
    assert expert_price.expert_group(inside, cluster).per_node == 8
    assert expert_price.expert_group(across, cluster).per_node == 4
    assert expert_price.exchange_seconds(MIXTRAL, across, cluster) > \
        5 * expert_price.exchange_seconds(MIXTRAL, inside, cluster)


def test_the_plan_chooses_an_expert_degree_and_converts_to_its_config():
    cluster = A100.with_nodes(8)
    plan = plan_cluster(cluster=cluster, global_batch=512, shape=MIXTRAL)
    lay = plan.layout
    assert plan.fits and lay.expert > 1 and MIXTRAL.experts % lay.expert == 0
    assert f"expert {lay.expert}" in plan.explain()
    config = plan.to_config().resolve(cluster.devices)
    assert (config.expert_degree, config.data_degree, config.pipeline_degree) == (
        lay.expert, lay.data, lay.pipeline)
    dense = dataclasses.replace(MIXTRAL, experts=0, top_k=0)
    assert plan_cluster(cluster=cluster, global_batch=512, shape=dense).layout.expert == 1


@pytest.mark.parametrize("fields, message", [
    (dict(expert=3), "expert=3 shards each MoE layer's experts: it must divide them"),
    (dict(expert=2, optimizer_offload=0.5), "offloading is priced for dense layers only"),
    (dict(expert=0), "expert must be a positive int"),
])
def test_bad_expert_layouts_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        price_cluster_plan(cluster=A100.with_nodes(8), global_batch=512, shape=MIXTRAL,
                           tensor=1, pipeline=8, **fields)


def test_bad_moe_shapes_are_refused_by_name():
    with pytest.raises(ValueError, match="expert=2 shards .*the model has no experts"):
        price_cluster_plan(cluster=A100, global_batch=8, tensor=1, pipeline=1, expert=2,
                           shape=TransformerShape(4, 256, 8, 64, 1000))
    with pytest.raises(ValueError, match="top_k=3 must be 1 to experts=2"):
        TransformerShape(4, 256, 8, 64, 1000, experts=2, top_k=3)
    with pytest.raises(ValueError, match="give experts= too"):
        TransformerShape(4, 256, 8, 64, 1000, top_k=2)
    with pytest.raises(ValueError, match="moe_layers=5 exceeds layers=4"):
        TransformerShape(4, 256, 8, 64, 1000, experts=2, top_k=1, moe_layers=5)
