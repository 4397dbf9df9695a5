"""Megatron's sequence parallel as a strategy preset (``conf/strategy/gpt_megatron_sp.yaml``,
and ``hf_llama_megatron_sp.yaml`` for the HuggingFace Llama family): on 2 tensor-parallel gloo
ranks the model trains like plain tensor parallel and one process, its norms (LayerNorm,
HuggingFace's RMSNorm) hold half the sequence, and the row-parallel Linear's all-reduce becomes a
reduce-scatter onto the sequence slices with an all-gather before the next column-parallel one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

import parallel
from comm_counter import collectives
from distributed import run_ranks
from foundation.compat import dtensor_folds_sharded_dims
from parallel import ParallelConfig
from parallel.semi_auto import load_strategy_file
from recipes.gpt import GPT

pytestmark = pytest.mark.slow
STRATEGIES = Path(__file__).resolve().parents[1] / "conf" / "strategy"


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    idx, targets = (torch.randint(0, 50, (4, 16), generator=gen) for _ in range(2))
    return idx, targets


def _one_step(preset: str) -> dict:
    """One forward and backward of the GPT under ``preset`` on 2 tensor ranks: the loss, the
    placements of the second norm's input, the collectives issued, every full gradient."""
    torch.manual_seed(0)
    model = GPT(50, d_model=32, n_layer=2, n_head=4, block_size=16)
    strategies = load_strategy_file(STRATEGIES / f"{preset}.yaml", dp=1, mp=2)
    sharded = parallel.parallelize(model, ParallelConfig(tensor_degree=2,
                                                         strategies=strategies)).model
    seen: dict = {}

    def record(_module: torch.nn.Module, args: tuple) -> None:
        seen.setdefault("ln2", args[0].placements)
    hook = model.blocks[0].ln2.register_forward_pre_hook(record)
    losses = []

    def step() -> None:
        _, loss = sharded(*_batch())
        loss.backward()
        losses.append(loss.full_tensor() if isinstance(loss, DTensor) else loss)
    calls = collectives(step)
    hook.remove()
    return {"loss": float(losses[0]), "ln2": seen["ln2"],
            "calls": {k: len(v) for k, v in calls.items()},
            "grad": {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                     for n, p in model.named_parameters()}}


def _train(rank: int, world: int) -> dict:
    parallel.init()
    out = {preset: _one_step(preset) for preset in ("gpt_megatron", "gpt_megatron_sp")}
    torch.manual_seed(0)
    reference = GPT(50, d_model=32, n_layer=2, n_head=4, block_size=16)
    _, loss = reference(*_batch())
    loss.backward()
    out["one"] = {"loss": float(loss), "grad": {n: p.grad for n, p in
                                                 reference.named_parameters()}}
    return out


def test_sequence_parallel_trains_like_tensor_parallel_with_the_sequence_split():
    result = run_ranks(_train, 2, timeout=200)[0]
    plain, sp, one = result["gpt_megatron"], result["gpt_megatron_sp"], result["one"]
    assert sp["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert plain["loss"] == pytest.approx(one["loss"], rel=1e-5)
    for name, grad in one["grad"].items():
        torch.testing.assert_close(sp["grad"][name], grad, rtol=1e-5, atol=1e-6, msg=name)
    assert Shard(1) in sp["ln2"] and Shard(1) not in plain["ln2"]  # half the sequence each
    # activations move by all-gather and reduce-scatter; plain tensor parallel all-reduces
    # them (sequence parallel all-reduces the norms' and embeddings' weight gradients instead,
    # which every rank computed from its slice of the sequence)
    assert sp["calls"].get("reduce_scatter_tensor", 0) > 0
    assert sp["calls"].get("all_gather_into_tensor", 0) > 0
    assert "reduce_scatter_tensor" not in plain["calls"]


def _moved_like_torch_2_11(rank: int, world: int) -> dict:
    """The sequence-parallel step with each Linear's split sequence moved to the front, as on
    torch 2.11 (whose DTensor cannot fold a split middle dim: ``sharded_rows``), here forced."""
    from parallel.semi_auto import sharded_rows

    parallel.init()
    folds = sharded_rows.dtensor_folds_sharded_dims
    sharded_rows.dtensor_folds_sharded_dims = lambda: False
    try:
        return _one_step("gpt_megatron_sp")
    finally:
        sharded_rows.dtensor_folds_sharded_dims = folds


def test_linears_over_a_split_sequence_moved_to_the_front_compute_the_same():
    moved = run_ranks(_moved_like_torch_2_11, 2, timeout=200)[0]
    torch.manual_seed(0)
    reference = GPT(50, d_model=32, n_layer=2, n_head=4, block_size=16)
    _, loss = reference(*_batch())
    loss.backward()
    assert moved["loss"] == pytest.approx(float(loss), rel=1e-5)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(moved["grad"][name], p.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert Shard(1) in moved["ln2"]


def _llama() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        attn_implementation="sdpa")
    return transformers.AutoModelForCausalLM.from_config(config)


def _llama_step(model: torch.nn.Module, forward: torch.nn.Module) -> torch.Tensor:
    logits = forward(_batch()[0], use_cache=False).logits
    logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
    loss = logits.float().square().mean()  # every logit's gradient, not only the targets'
    loss.backward()
    return loss


def _llama_presets(rank: int, world: int) -> dict:
    parallel.init()
    out: dict = {}
    for preset in ("hf_llama_megatron", "hf_llama_megatron_sp"):
        model = _llama()
        strategies = load_strategy_file(STRATEGIES / f"{preset}.yaml", dp=1, mp=2)
        sharded = parallel.parallelize(model, ParallelConfig(tensor_degree=2,
                                                             strategies=strategies)).model
        seen: dict = {}

        def record(_module: torch.nn.Module, args: tuple, seen: dict = seen) -> None:
            seen.setdefault("norm", args[0].placements)
        hook = model.model.layers[0].post_attention_layernorm.register_forward_pre_hook(record)
        losses = []
        calls = collectives(lambda model=model, sharded=sharded, losses=losses: losses.append(
            _llama_step(model, sharded)))
        hook.remove()
        out[preset] = {"loss": float(losses[0]), "norm": seen["norm"],
                       "calls": {k: len(v) for k, v in calls.items()},
                       "grad": {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor)
                                    else p.grad).clone() for n, p in model.named_parameters()}}
    reference = _llama()
    out["one"] = {"loss": float(_llama_step(reference, reference)),
                  "grad": {n: p.grad for n, p in reference.named_parameters()}}
    return out


def test_the_llama_family_preset_splits_its_rms_norms_on_the_sequence():
    result = run_ranks(_llama_presets, 2, timeout=200)[0]
    plain, sp, one = result["hf_llama_megatron"], result["hf_llama_megatron_sp"], result["one"]
    for preset in (plain, sp):
        assert preset["loss"] == pytest.approx(one["loss"], rel=1e-5)
        for name, grad in one["grad"].items():
            torch.testing.assert_close(preset["grad"][name], grad, rtol=1e-5, atol=1e-6,
                                       msg=name)
    assert Shard(1) in sp["norm"] and Shard(1) not in plain["norm"]  # half the sequence each
    if not dtensor_folds_sharded_dims():  # torch 2.11: DTensor picks other collectives for
        return  # the Linears moved to fold (parallel/semi_auto/sharded_rows.py)
    assert sp["calls"]["all_gather_into_tensor"] > plain["calls"]["all_gather_into_tensor"]
    assert sp["calls"].get("all_reduce", 0) < plain["calls"]["all_reduce"]
