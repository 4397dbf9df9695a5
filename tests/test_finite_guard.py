"""``recipes.finite_guard``: an update guarded by its loss being finite, read by the host before
the update, or, where the optimizer skips on the device, a step later without waiting."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from recipes.finite_guard import FiniteGuard, NonFiniteLossError, skips_on_device


def _model_and_optimizer(**kwargs) -> tuple[nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1, **kwargs)


def _backward(model: nn.Linear, poison: bool = False) -> torch.Tensor:
    loss = model(torch.ones(3, 4)).square().mean()
    if poison:
        loss = loss * float("nan")
    model.zero_grad()
    loss.backward()
    return loss.detach()


def test_only_a_fused_step_over_plain_weights_without_a_scaler_skips_on_the_device():
    model, fused = _model_and_optimizer(fused=True)
    assert skips_on_device(fused, model.parameters(), scaled=False)
    assert not skips_on_device(fused, model.parameters(), scaled=True)  # the scaler decides
    _, foreach = _model_and_optimizer(foreach=True)
    assert not skips_on_device(foreach, model.parameters(), scaled=False)
    assert not skips_on_device(torch.optim.SGD(model.parameters(), lr=0.1),
                               model.parameters(), scaled=False)


def test_the_device_skips_the_update_and_stop_raises_at_the_next_step_before_its_update():
    model, opt = _model_and_optimizer(fused=True)
    guard = FiniteGuard("stop", [])
    guard.step(1, _backward(model), opt.step, opt, on_device=True)
    after_one = [p.detach().clone() for p in model.parameters()]
    guard.step(2, _backward(model, poison=True), opt.step, opt, on_device=True)  # not read yet
    for p, before in zip(model.parameters(), after_one, strict=True):
        assert torch.equal(p, before)  # the kernel skipped it
    assert all(float(s["step"]) == 1 for s in opt.state.values())
    assert not hasattr(opt, "found_inf")  # handed to the step only
    updates = []
    with pytest.raises(NonFiniteLossError, match="step 2: the loss is nan"):
        guard.step(3, _backward(model), lambda: updates.append(3), opt, on_device=True)
    assert updates == []  # raised before step 3's update


def test_skip_records_the_step_and_the_run_goes_on():
    model, opt = _model_and_optimizer(fused=True)
    skipped: list[int] = []
    guard = FiniteGuard("skip", skipped)
    guard.step(1, _backward(model, poison=True), opt.step, opt, on_device=True)
    guard.step(2, _backward(model), opt.step, opt, on_device=True)
    guard.settle()
    assert skipped == [1]
    assert all(float(s["step"]) == 1 for s in opt.state.values())  # step 2 only


def test_on_the_host_the_flag_is_read_before_the_update():
    model, opt = _model_and_optimizer()
    guard = FiniteGuard("stop", [])
    updates = []
    with pytest.raises(NonFiniteLossError, match="step 1"):
        guard.step(1, _backward(model, poison=True), lambda: updates.append(1), opt,
                   on_device=False)
    assert updates == []


def test_the_recipes_fuse_torch_optimizers_on_a_gpu_unless_told(monkeypatch):
    """On a device that fuses them (meta stands in for a GPU here) the recipes' AdamW is fused,
    so its steps skip on the device; a config's own ``fused``/``foreach`` wins; the host keeps
    torch's default."""
    from omegaconf import OmegaConf

    import foundation.device as hd
    from recipes.optim import fused_default

    adamw = OmegaConf.create({"_target_": "torch.optim.AdamW", "lr": 0.1})
    on_device = nn.Linear(2, 2, device="meta")
    assert fused_default(adamw, nn.Linear(2, 2)) == {}  # the host
    monkeypatch.setattr(hd, "_FUSED_OPTIMIZER_TYPES", frozenset({"meta"}))
    assert fused_default(adamw, on_device) == {"fused": True}
    for said in ({"fused": False}, {"foreach": True}):
        assert fused_default(OmegaConf.merge(adamw, said), on_device) == {}
    other = OmegaConf.create({"_target_": "hetero.optim.LazyAdam"})
    assert fused_default(other, on_device) == {}
    mixed = nn.Sequential(nn.Linear(2, 2, device="meta"), nn.Linear(2, 2))
    assert fused_default(adamw, mixed) == {}  # host weights beside: torch's default
