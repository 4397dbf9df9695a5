"""``parallel.recompute``: activations recomputed in backward, with the losses and gradients of the
run without recompute (dropout included: the RNG state is replayed), less activation memory
held between forward and backward, and the same training under data, semi-auto, pipeline,
optimizer parallel and expert parallel on 4 gloo ranks (one spawn)."""

from __future__ import annotations

import pytest
import torch
from held_bytes import HeldBytes  # the instrument memory_scale.py reports with

import hetero
import parallel
from distributed import run_ranks
from parallel import ParallelConfig
from parallel.recompute import SHARED_OFFLOAD
from parallel.semi_auto import load_strategy_file
from pipeline_helpers import BATCH, batch, full_params, gpt_loss, tiny_gpt
from recipes.gpt import GPT

STEPS = 3


def _gpt(dropout: float = 0.0, moe: bool = False) -> GPT:
    torch.manual_seed(0)
    return GPT(37, d_model=32, n_layer=3, n_head=4, block_size=8, dropout=dropout,
               moe={"num_experts": 4, "top_k": 2, "dropless": True} if moe else None,
               moe_every=2)


def _one_process(mode: str) -> tuple[float, list[torch.Tensor], int]:
    model = _gpt(dropout=0.1)
    parallel.recompute_layers(model, "blocks.*", mode)
    torch.manual_seed(1)  # the dropout masks
    x, y = batch(0)
    tracker = HeldBytes()
    with tracker:
        _, loss = model(x, y)
    # the bytes kept on the device: activation offload's host copies are made inside too
    held = tracker.held() - SHARED_OFFLOAD.host_bytes()
    loss.backward()
    return loss.item(), [p.grad for p in model.parameters()], held


def test_recompute_gives_the_same_loss_and_gradients_and_holds_less():
    loss, grads, held = _one_process("none")
    found = {}
    for mode in ("selective", "full"):
        found[mode] = _one_process(mode)
        assert found[mode][0] == loss
        assert all(torch.equal(a, b) for a, b in zip(found[mode][1], grads, strict=True))
    assert found["full"][2] < found["selective"][2] < held  # bytes kept for backward


def test_activation_offload_gives_the_same_training_and_keeps_no_activation_on_the_device():
    loss, grads, held = _one_process("none")
    _, _, full = _one_process("full")
    offload = SHARED_OFFLOAD
    offload.reset_counts()
    off_loss, off_grads, off_held = _one_process("offload")
    assert off_loss == loss
    assert all(torch.equal(a, b) for a, b in zip(off_grads, grads, strict=True))
    assert offload.to_host > 0 and offload.host_bytes() == 0  # all given back by backward
    # what the blocks saved went to host copies: the device keeps their outputs, at most what
    # full recompute keeps (each block's input)
    assert off_held <= full < held


def test_activation_offload_leaves_the_weights_a_layer_saves_where_they_are():
    """``F.linear`` saves ``weight.t()`` for backward, a view of the parameter the model holds
    anyway: only the input goes to the host, not the weight (both ways, every step)."""
    from hetero.offload.activations import ActivationOffload, offload_activations

    offload = ActivationOffload()
    layer = offload_activations(torch.nn.Linear(64, 64), offload)
    x = torch.randn(8, 64, requires_grad=True)
    out = layer(x)
    assert (offload.to_host, offload.host_bytes()) == (1, x.nbytes)
    out.sum().backward()
    assert torch.equal(layer.weight.grad, torch.ones(64, 8) @ x.detach())


def test_only_the_named_layers_are_recomputed_and_inference_is_unchanged():
    model = _gpt()
    assert parallel.recompute_layers(model, "blocks.*", "selective") == [
        "blocks.0", "blocks.1", "blocks.2"]
    assert parallel.recompute_layers(model, "ln_f", "none") == []
    x, _ = batch(0)
    with torch.no_grad():
        torch.testing.assert_close(model(x), _gpt()(x), rtol=0, atol=0)


@pytest.mark.parametrize("call, message", [
    (lambda m: parallel.recompute(m, "most"), "mode 'most' is not one of"),
    (lambda m: parallel.recompute_layers(m, "layers.*", "full"), "no module of GPT matches"),
    (lambda m: parallel.recompute(parallel.recompute(m.blocks[0]), "full"),
     "Block is already recomputed"),
    (lambda m: parallel.recompute_layers(m, "blocks.*", "sometimes"), "'sometimes' is not one"),
])
def test_bad_requests_are_refused_by_name(call, message):
    with pytest.raises(ValueError, match=message):
        call(_gpt())


def test_a_placed_model_is_refused_before_any_change():
    model = tiny_gpt(2)
    hetero.set_device(model.tok_emb, "cpu")
    placed = hetero.place(model, (batch(0)[0],))
    with pytest.raises(ValueError, match="recompute of a hetero.place'd model is not built"):
        parallel.recompute_layers(placed, "blocks.*", "full")
    assert parallel.recompute.__module__ and not hasattr(model.blocks[0], "_parallel_recompute")


# ---------------------------------------------------------------- 4 gloo ranks
def _megatron(data: int, tensor: int) -> dict:
    return load_strategy_file("conf/strategy/gpt_megatron.yaml", dp=data, mp=tensor)


CASES = {  # name -> (config, MoE model, the recompute modes compared with none)
    "data": (ParallelConfig(data_degree=4), False, ("selective", "full", "offload")),
    "semi_auto": (ParallelConfig(tensor_degree=2,
                                 strategies=_megatron(2, 2)), False,
                  ("selective", "full", "offload")),
    "pipeline": (ParallelConfig(pipeline_degree=2, micro_batches=2), False, ("full", "offload")),
    "optimizer level3": (ParallelConfig(enable_parallel_optimizer=True, optimizer_level="level3",
                                        parallel_optimizer_threshold=0), False,
                         ("selective", "full", "offload")),
    "expert": (ParallelConfig(expert_degree=2), True, ("full", "offload")),
}


def _train(config: ParallelConfig, moe: bool, mode: str) -> tuple[list[float], dict]:
    staged = config.pipeline_degree > 1
    result = parallel.parallelize(_gpt(moe=moe), config, loss_fn=gpt_loss if staged else None)
    model, resolved = result.model, result.config
    parallel.recompute_layers(model, "blocks.*", mode)
    sliced = resolved.mode.value == "data_parallel"
    per = BATCH // resolved.batch_ranks if sliced else BATCH
    start = result.dims["batch"].get_local_rank() * per if sliced else 0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        x, y = (t[start:start + per] for t in batch(step))
        opt.zero_grad()
        if isinstance(model, parallel.pipeline.Pipeline):
            losses.append(model.step(x, target=y).item())
        else:
            _, loss = model(x, y)
            loss.backward()
            losses.append(loss.item())
        opt.step()
    return losses, full_params(model)


def _cases(rank: int, world: int) -> dict:
    parallel.init()
    return {(name, mode): _train(config, moe, mode)
            for name, (config, moe, modes) in CASES.items() for mode in ("none", *modes)}


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_ranks(_cases, 4, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_recompute_trains_like_no_recompute_in_every_mode(four_ranks, name):
    for results in four_ranks:
        want_losses, want_params = results[(name, "none")]
        for mode in CASES[name][2]:
            losses, params = results[(name, mode)]
            assert losses == pytest.approx(want_losses, rel=1e-6), (name, mode)
            for key, value in params.items():
                where = f"{name} {mode} {key}"
                torch.testing.assert_close(value, want_params[key], rtol=1e-6, atol=1e-7,
                                           msg=lambda m, where=where: f"{where}: {m}")


@pytest.mark.slow
def test_the_recipe_setting_recomputes_every_block_with_the_same_losses(tmp_path):
    from recipe_helpers import losses_of, run_recipe

    steps = ["trainer.max_steps=3", "model.n_layer=2", "model.dropout=0.1"]
    run_recipe([*steps, "parallel=data", "trainer.recompute=selective"], 2,
               tmp_path / "selective", tmp_path / "data")
    run_recipe([*steps, "parallel=data", "trainer.recompute=none"], 2, tmp_path / "none",
               tmp_path / "data")
    assert losses_of(tmp_path / "selective") == losses_of(tmp_path / "none")
    assert "recompute (selective): 2 blocks" in (tmp_path / "selective" / "train.log").read_text()


@pytest.mark.parametrize("mode", ["full", "selective", "offload"])
def test_a_copy_of_a_wrapped_module_runs_its_own_weights(mode):
    """Capture (hetero.place, the auto planner) traces a deep copy with fake twins of the
    tensors: the copy's forward must use the copy's, not the original's (a meta-built model
    under parallel=auto with trainer.recompute failed on the original's meta weights)."""
    import copy

    layer = parallel.recompute(torch.nn.Linear(4, 4), mode)
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        twin.weight.zero_()
        twin.bias.fill_(2.0)
    x = torch.randn(3, 4, requires_grad=True)
    out = twin(x)
    assert torch.equal(out, torch.full((3, 4), 2.0))
    out.sum().backward()
    assert torch.equal(twin.weight.grad, x.detach().sum(0).expand(4, 4))
    assert layer.weight.grad is None and not torch.equal(layer(x), out)
