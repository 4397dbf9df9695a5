"""OffloadAdamW in a training loop: gradient hooks and buckets, accumulation, clipping, fp16 loss
scaling, device memory, a hetero.place'd model, and the GPT recipe with ``offload=optimizer``.

Without an accelerator the "device" is the CPU: 16-bit parameters still take the offloaded path
(hooks, buckets, landing buffers, send-back), which is what these tests exercise.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import foundation.device as hd
import hetero
from hetero.optim import LossScaler, OffloadAdamW
from recipe_helpers import losses_of, run_recipe
from recipes.gpt import GPT

ATOL = 1e-7  # one float32 ulp at the parameters' scale, see test_offload_adam.py


def _mlp(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(),
                         nn.Linear(32, 4)).to(dtype)


def _batches(n: int, seed: int, dtype: torch.dtype, rows: int = 6) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, 8, generator=gen).to(dtype) for _ in range(n)]


def _loss(model: nn.Module, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    return model(x).float().pow(2).mean() * scale


def _twin_grads(model: nn.Module, twin: nn.Module, x: torch.Tensor, scale: float = 1.0):
    """Upcast gradients that ``model``'s device copies produce on ``x`` (via a twin module)."""
    with torch.no_grad():
        for t, p in zip(twin.parameters(), model.parameters(), strict=True):
            t.copy_(p)
    twin.zero_grad()
    _loss(twin, x, scale).backward()
    return [t.grad.float() for t in twin.parameters()]


def test_hooks_send_gradients_in_buckets_and_release_them():
    runs = {}
    for name, kwargs in {"small buckets": dict(bucket_cap_mb=0.004),
                         "one bucket": dict(bucket_cap_mb=100),
                         "copied at step": dict(overlap_backward=False)}.items():
        model = _mlp()
        opt = OffloadAdamW(model.parameters(), lr=1e-2, param_dtype=torch.bfloat16,
                           kernel="torch", **kwargs)
        for x in _batches(3, seed=1, dtype=torch.bfloat16):
            _loss(model, x).backward()
            grads_on_device = [p.grad is not None for p in model.parameters()]
            assert all(grads_on_device) == (name == "copied at step"), name
            opt.step()
            opt.zero_grad()
        runs[name] = (model, opt)
    largest = max(p.numel() * 2 for p in runs["small buckets"][0].parameters())
    stats = runs["small buckets"][1].memory_stats()
    assert stats["peak_device_grad_bytes"] <= int(0.004 * 2**20) + largest
    assert stats["device_bytes"] == 2 * stats["num_params"]  # bf16 weights, no gradients left
    ref_model = runs["one bucket"][0]
    for name, (model, _) in runs.items():
        for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
            assert torch.equal(p, q), name


def test_accumulated_micro_batches_give_the_whole_batch_update():
    # Exactly representable arithmetic: integer inputs and a linear loss make every bf16
    # gradient exact, so three micro-batches and the whole batch must agree bit for bit.
    finals = []
    for splits in (1, 3):
        torch.manual_seed(0)
        lin = nn.Linear(4, 2, bias=False)
        opt = OffloadAdamW(lin.parameters(), lr=0.1, param_dtype=torch.bfloat16, kernel="torch")
        x = torch.randint(-3, 4, (6, 4)).to(torch.bfloat16)
        for part in x.chunk(splits):
            lin(part).float().sum().backward()
        opt.step()
        finals.append(opt.state[lin.weight]["fp32_master"].clone())
    assert torch.equal(finals[0], finals[1])
    # A real model: the update is AdamW's on the FP32 sum of the micro-batches' gradients.
    model, twin = _mlp(), _mlp(dtype=torch.bfloat16)
    ref_params = [nn.Parameter(p.detach().clone()) for p in model.parameters()]  # FP32 start
    opt = OffloadAdamW(model.parameters(), lr=1e-2, param_dtype=torch.bfloat16, kernel="torch")
    ref = torch.optim.AdamW(ref_params, lr=1e-2)
    for x in _batches(2, seed=3, dtype=torch.bfloat16, rows=9):
        micro = [_twin_grads(model, twin, part, 1 / 3) for part in x.chunk(3)]
        for part in x.chunk(3):
            _loss(model, part, 1 / 3).backward()
        for r, *gs in zip(ref_params, *micro, strict=True):
            r.grad = sum(gs)
        opt.step()
        ref.step()
    for p, r in zip(model.parameters(), ref_params, strict=True):
        torch.testing.assert_close(opt.state[p]["fp32_master"], r.detach(), rtol=1e-6, atol=ATOL)


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_clip_grad_norm_on_host_gradients_matches_torch(param_dtype):
    model, twin = _mlp(), _mlp(dtype=param_dtype or torch.float32)
    ref_params = [nn.Parameter(p.detach().clone()) for p in model.parameters()]  # FP32 start
    opt = OffloadAdamW(model.parameters(), lr=1e-2, param_dtype=param_dtype, kernel="torch")
    ref = torch.optim.AdamW(ref_params, lr=1e-2)
    for x in _batches(3, seed=4, dtype=param_dtype or torch.float32):
        grads = _twin_grads(model, twin, x)
        _loss(model, x).backward()
        for r, g in zip(ref_params, grads, strict=True):
            r.grad = g
        expected = torch.nn.utils.clip_grad_norm_(ref_params, max_norm=0.05)
        total = opt.clip_grad_norm_(0.05)
        torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
        opt.step()
        ref.step()
        opt.zero_grad()
    masters = [p if param_dtype is None else opt.state[p]["fp32_master"]
               for p in model.parameters()]
    for m, r in zip(masters, ref_params, strict=True):
        torch.testing.assert_close(m.detach(), r.detach(), rtol=1e-6, atol=ATOL)


def test_fp16_loss_scaling_skips_overflowing_steps_and_adapts_the_scale():
    model, twin = _mlp(), _mlp(dtype=torch.float16)
    ref_params = [nn.Parameter(p.detach().clone()) for p in model.parameters()]  # FP32 start
    opt = OffloadAdamW(model.parameters(), lr=1e-2, param_dtype=torch.float16, kernel="torch")
    ref = torch.optim.AdamW(ref_params, lr=1e-2)
    scaler = LossScaler(init_scale=2.0**10, growth_interval=2)
    for x in _batches(2, seed=5, dtype=torch.float16):
        grads = _twin_grads(model, twin, x, scaler.get_scale())
        scaler.scale(_loss(model, x)).backward()
        for r, g in zip(ref_params, grads, strict=True):
            r.grad = g / scaler.get_scale()
        scaler.step(opt)
        ref.step()
        scaler.update()
    assert scaler.get_scale() == 2.0**11  # grew after growth_interval clean steps
    masters = {p: opt.state[p]["fp32_master"].clone() for p in model.parameters()}
    for p, r in zip(model.parameters(), ref_params, strict=True):
        torch.testing.assert_close(masters[p], r.detach(), rtol=1e-6, atol=ATOL)
    steps = [opt.state[p]["step"].item() for p in model.parameters()]
    scaler.update(new_scale=2.0**40)  # fp16 gradients of this loss overflow
    scaler.scale(_loss(model, _batches(1, seed=6, dtype=torch.float16)[0])).backward()
    assert scaler.step(opt) is None and scaler.skipped_steps == 1
    scaler.update()
    assert scaler.get_scale() == 2.0**39
    for p in model.parameters():
        assert torch.equal(opt.state[p]["fp32_master"], masters[p])  # no Inf/NaN reached it
        assert torch.isfinite(p).all()
    assert [opt.state[p]["step"].item() for p in model.parameters()] == steps
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
        scaler.unscale_(opt)


def test_device_side_bytes_per_parameter():
    torch.manual_seed(0)
    model = GPT(40, d_model=64, n_layer=2, n_head=2, block_size=16)
    opt = OffloadAdamW(model.parameters(), param_dtype=torch.bfloat16, kernel="torch",
                       bucket_cap_mb=0.05)
    idx = torch.randint(0, 40, (4, 16))
    for _ in range(2):
        model(idx, idx)[1].backward()
        opt.step()
        opt.zero_grad()
    stats = opt.memory_stats()
    n = stats["num_params"]
    assert stats["device_bytes"] / n == 2.0  # bf16 weights only (standard mixed AdamW: 16)
    assert (stats["device_bytes"] + stats["peak_device_grad_bytes"]) / n <= 4.0
    assert stats["host_bytes"] / n == 16.0  # master, 2 moments, landing + send buffers


def test_a_deleted_optimizer_frees_its_host_buffers_and_hooks():
    model = _mlp()
    opt = OffloadAdamW(model.parameters(), param_dtype=torch.bfloat16, kernel="torch")
    arena = weakref.ref(opt._all_slots()[0].arena.flat("master"))
    del opt
    gc.collect()
    assert arena() is None
    _loss(model, _batches(1, seed=0, dtype=torch.bfloat16)[0]).backward()
    assert model[0].weight.grad is not None  # torch's own .grad again


def test_backward_and_assigned_grad_in_one_step_is_refused():
    model = _mlp()
    opt = OffloadAdamW(model.parameters(), param_dtype=torch.bfloat16, kernel="torch")
    _loss(model, _batches(1, seed=0, dtype=torch.bfloat16)[0]).backward()
    model[0].weight.grad = torch.zeros_like(model[0].weight)  # what torch DDP does after backward
    with pytest.raises(RuntimeError, match="overlap_backward=False"):
        opt.step()


def test_sparse_gradients_are_refused():
    for dtype, where in [(torch.bfloat16, "backward"), (None, "step")]:
        emb = nn.Embedding(10, 4, sparse=True)
        opt = OffloadAdamW(emb.parameters(), param_dtype=dtype, kernel="torch")
        before = emb.weight.detach().clone()
        with pytest.raises((ValueError, RuntimeError), match="sparse"):
            emb(torch.tensor([1, 2])).float().sum().backward()  # the hook refuses ...
            opt.step()  # ... or the step, for a host parameter updated in place
        assert torch.equal(emb.weight.detach(), before), where


@pytest.mark.skipif(not hasattr(hetero, "place"), reason="hetero.place is not built yet")
def test_on_a_placed_model_host_partitions_update_in_place():
    model, twin = _mlp(), _mlp()
    hetero.set_device(model[2], "cpu")
    x = _batches(1, seed=0, dtype=torch.float32)[0]
    placed = hetero.place(model, (x,))
    opt = OffloadAdamW(placed.parameters(), lr=1e-2, kernel="torch")
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    slots = {s.param: s for s in opt._all_slots()}
    assert slots[model[2].weight].in_place and slots[model[2].weight].master is not None
    for x in _batches(3, seed=7, dtype=torch.float32):
        _loss(placed, x.to(model[0].weight.device)).backward()
        _loss(twin, x).backward()
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    for p, r in zip(placed.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.detach().cpu(), r.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
def test_cuda_offload_matches_torch_and_keeps_device_memory_low():
    torch.manual_seed(0)
    dev = hd.resolve("device")
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).to(dev)
    ref_model = copy.deepcopy(model)
    opt = OffloadAdamW(model.parameters(), lr=1e-3, param_dtype=None, bucket_cap_mb=4)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3)
    for _ in range(3):
        x = torch.randn(4, 1024, device=dev)
        model(x).pow(2).mean().backward()
        ref_model(x).pow(2).mean().backward()
        opt.step()
        ref.step()
        ref.zero_grad()
    for p, r in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    model16 = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).to(dev)
    del opt, ref, model, ref_model
    hd.synchronize()
    opt16 = OffloadAdamW(model16.parameters(), param_dtype=torch.bfloat16, bucket_cap_mb=4)
    n = sum(p.numel() for p in model16.parameters())
    hd.synchronize()
    torch.accelerator.reset_peak_memory_stats()
    x = torch.randn(4, 1024, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        model16(x).float().pow(2).mean().backward()
        opt16.step()
    hd.synchronize()
    assert torch.accelerator.memory_allocated() / n <= 2.1
    assert torch.accelerator.max_memory_allocated() / n <= 4.0  # standard mixed AdamW: 16


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_gpt_recipe_with_hetero_offload_trains(tmp_path):
    cache = tmp_path / "data"
    one, two = tmp_path / "one", tmp_path / "two"
    # one process: gradients leave through the hooks; kernel=auto (the fused compiled kernel)
    run_recipe(["trainer.max_steps=8", "parallel=none", "offload=optimizer"], None, one, cache)
    # two ranks, DDP: reduced gradients are copied out at step()
    run_recipe(["trainer.max_steps=8", "offload=optimizer", "hetero.offload_kernel=torch"], 2,
               two, cache)
    for run in (one, two):
        losses = losses_of(run)
        assert sorted(losses) == list(range(1, 9))
        assert losses[8] < losses[1] - 0.4, losses


@pytest.mark.cuda
def test_cuda_group_with_offload_false_keeps_its_state_on_the_device():
    torch.manual_seed(0)
    dev = hd.resolve("device")
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256)).to(dev)
    ref_model = copy.deepcopy(model)
    opt = OffloadAdamW([{"params": model[0].parameters()},
                        {"params": model[1].parameters(), "offload": False}], lr=1e-3)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3)
    for _ in range(3):
        x = torch.randn(4, 256, device=dev)
        model(x).pow(2).mean().backward()
        ref_model(x).pow(2).mean().backward()
        opt.clip_grad_norm_(1.0)
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1.0)
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    for p, r in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    assert opt.state[model[1].weight]["exp_avg"].device == dev
    assert opt.state[model[0].weight]["exp_avg"].device.type == "cpu"
    kept = sum(p.numel() for p in model[1].parameters()) * 8  # two FP32 moments
    assert opt.memory_stats()["device_bytes"] >= kept
