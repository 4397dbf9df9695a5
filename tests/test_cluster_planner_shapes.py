"""The cluster planner reads any decoder from its captured graph: a user's own decoder with names
of its own plans as the recipe GPT of the same sizes; grouped-query attention, SwiGLU and an
untied head are read and priced by their FLOPs and parameters; a model the graph does not show
as a decoder is refused naming the missing part."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import parallel
from custom_lm import TinyLM
from distributed import run_ranks
from parallel.auto import ClusterSpec, TransformerShape
from parallel.auto.cluster_planner import (  # the package's plan_cluster is also a module
    Layout,
    plan_cluster,
    price,
    price_cluster_plan,
)
from parallel.auto.transformer_shape import shape_of
from parallel.semi_auto import load_strategy_file
from pipeline_helpers import reference, train_pipelined
from recipes.gpt import GPT
from user_decoders import MyDecoder

A100 = dataclasses.replace(ClusterSpec.preset("a100-80gb"), nodes=2, devices_per_node=8)


def _ids(seq: int) -> tuple[torch.Tensor]:
    return (torch.zeros(1, seq, dtype=torch.long, device="meta"),)


def test_a_users_decoder_plans_as_the_recipe_gpt_of_the_same_sizes():
    with torch.device("meta"):
        mine = MyDecoder(vocab=51200, width=2048, depth=24, heads=16, max_len=2048)
        gpt = GPT(51200, d_model=2048, n_layer=24, n_head=16, block_size=2048)
    read = shape_of(mine, _ids(2048))
    assert read == shape_of(gpt, _ids(2048)) == TransformerShape(24, 2048, 16, 2048, 51200, 8192)
    plans = [plan_cluster(model, _ids(2048), cluster=A100, global_batch=64, operator_search=None)
             for model in (mine, gpt)]
    assert plans[0].layout == plans[1].layout and plans[0].step_time == plans[1].step_time


def test_grouped_queries_swiglu_and_an_untied_head_are_read_and_priced():
    with torch.device("meta"):
        llama_like = MyDecoder(vocab=32000, width=1024, depth=8, heads=16, kv_heads=4, ffn=2816,
                               gated=True, tied=False, max_len=None)
    shape = shape_of(llama_like, _ids(512))
    assert shape == TransformerShape(8, 1024, 16, 512, 32000, 2816, kv_heads=4, gated=True,
                                     tied=False)
    h = 1024
    assert shape.matmul_params == 2 * h * h + 2 * h * (h // 4) + 3 * h * 2816
    full = TransformerShape(8, 1024, 16, 512, 32000, 2816)  # every head, GELU MLP, tied
    assert shape.flops_per_token() - full.flops_per_token() == \
        3 * 8 * 2 * (shape.matmul_params - full.matmul_params)
    assert shape.params - full.params == 8 * (shape.matmul_params - full.matmul_params) + \
        32000 * h  # the head's own table
    # within what the formula counts roughly: a position table of the sequence's length (this
    # model has none), norms and biases
    assert shape.params == pytest.approx(sum(p.numel() for p in llama_like.parameters()),
                                         rel=5e-3)


def test_huggingface_families_are_read_from_their_graphs():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=5,
                                      num_attention_heads=8, num_key_value_heads=2,
                                      vocab_size=1000)
    with torch.device("meta"):
        llama = transformers.AutoModelForCausalLM.from_config(config)
        gpt2 = transformers.AutoModelForCausalLM.from_config(transformers.GPT2Config(
            n_embd=128, n_layer=5, n_head=4, vocab_size=1000))
    assert shape_of(llama, _ids(64)) == TransformerShape(5, 256, 8, 64, 1000, 688, kv_heads=2,
                                                         gated=True, tied=False)
    assert shape_of(gpt2, _ids(64)) == TransformerShape(5, 128, 4, 64, 1000, 512)
    assert llama.config.use_cache  # read without its cache, and given back as it was


def test_a_model_without_attention_is_refused_naming_what_is_missing():
    with torch.device("meta"):
        model = TinyLM(100)
    with pytest.raises(ValueError, match="TinyLM: its captured graph has no "
                                         "scaled_dot_product_attention call"):
        shape_of(model, _ids(16))


def test_an_uneven_pipeline_split_is_priced_by_its_fullest_stage():
    """BLOOM-176B's published layout: 70 layers on 12 stages (6 on the fullest), tensor 4, data
    8 on 384 A100s; its stages compute as long as those of a 72-layer model's even split."""
    cluster = dataclasses.replace(ClusterSpec.preset("a100-80gb"), nodes=48, devices_per_node=8)
    bloom = TransformerShape(70, 14336, 112, 2048, 250880)
    plan = price_cluster_plan(cluster=cluster, global_batch=2048, tensor=4, pipeline=12,
                              micro_batch_size=2, recompute="full", optimizer_level="level1",
                              shape=bloom)
    even = price(dataclasses.replace(bloom, layers=72), plan.layout, cluster, 2048)
    assert plan.breakdown["compute"] == pytest.approx(even.breakdown["compute"], rel=1e-12)
    assert plan.breakdown["tensor"] == pytest.approx(even.breakdown["tensor"], rel=1e-12)
    assert plan.breakdown["data"] < even.breakdown["data"]  # fewer parameters to reduce
    assert plan_cluster(cluster=cluster, global_batch=2048, shape=bloom).fits
    assert Layout(4, 12, 8, 2, 128, 1, "level1", "full") == plan.layout


def _three_layers_on_two_stages(rank: int, world: int) -> list[float]:
    return train_pipelined(parallel.ParallelConfig(pipeline_degree=2, micro_batches=2), 3,
                           n_layer=3)[0]


def test_an_uneven_pipeline_split_trains_like_one_process():
    want, _ = reference(3, n_layer=3)
    for losses in run_ranks(_three_layers_on_two_stages, 2)[1:]:  # the last stage's losses
        assert losses == pytest.approx(want, rel=1e-5)


def test_a_long_sequence_is_planned_with_a_context_split():
    """At 64 k tokens one rank cannot hold a 1.4 B model's activations: splitting the sequence
    divides them, ring attention's exchange hides behind the attention it feeds, and the plan
    converts to the ParallelConfig that builds it."""
    from parallel.auto import context_price

    node = dataclasses.replace(ClusterSpec.preset("a100-80gb"), nodes=1, devices_per_node=8)
    shape = TransformerShape(24, 2048, 16, 65536, 50304)
    priced = {c: price_cluster_plan(cluster=node, global_batch=8, tensor=1, pipeline=1,
                                    context=c, optimizer_level="level3", shape=shape)
              for c in (1, 2, 8)}
    assert not priced[1].fits and priced[8].fits
    assert priced[1].memory > 1.9 * priced[2].memory > 3.6 * priced[8].memory
    assert priced[8].breakdown["context"] == 0.0  # 64 k tokens of attention hide the passes
    plan = plan_cluster(cluster=node, global_batch=8, shape=shape)
    assert plan.layout.context > 1 and plan.fits
    config = plan.to_config()
    assert config.context_degree == plan.layout.context
    assert config.data_degree * config.context_degree == 8
    # the passes: k and v forward (and again under full recompute) and backward, the fp32
    # accumulators home
    two = dataclasses.replace(priced[2].layout, recompute="none")
    block = 2 * 65536 / 2 * 2048
    assert context_price.ring_bytes(shape, two) == block * (1 * 2 * 2 + 2 * 4)
    short = price_cluster_plan(cluster=node, global_batch=8, tensor=1, pipeline=1, context=8,
                               shape=dataclasses.replace(shape, seq=2048))
    assert short.breakdown["context"] > 0  # 256 tokens a rank: the passes outlast attention
    with pytest.raises(ValueError, match="2 × context = 16 balanced chunks"):
        price_cluster_plan(cluster=node, global_batch=8, tensor=1, pipeline=1, context=8,
                           shape=dataclasses.replace(shape, seq=2056))
    # with tensor parallel: each tensor rank passes its heads' keys and values, and the plan
    # converts to strategies fed the whole batch (the dataset strategy takes no split sequence)
    both = price_cluster_plan(cluster=node, global_batch=8, tensor=2, pipeline=1, context=2,
                              shape=shape)
    assert context_price.ring_bytes(shape, both.layout) == context_price.ring_bytes(
        shape, dataclasses.replace(both.layout, tensor=1)) / 2
    config = both.to_config(load_strategy_file("conf/strategy/gpt_megatron.yaml", dp=2, mp=2))
    assert (config.tensor_degree, config.context_degree, config.full_batch) == (2, 2, True)
