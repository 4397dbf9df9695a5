"""Hot paths that must not copy from the host to an accelerator on every call (issue 39): a
``torch.tensor(x, device=...)`` is a pageable copy the host waits for. Fake CUDA tensors
(``FakeTensorMode``) stand in for the accelerator, and a dispatch mode records every op that
reads a host tensor into a device one."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from foundation.compat import fused_adam_
from hetero.optim.lazy_adam import _adam_math


class HostToDevice(TorchDispatchMode):
    """Records the ops that take a host tensor and give a device one."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (list, tuple)) else [out]
        if any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in args) and any(
                isinstance(o, torch.Tensor) and o.device.type == "cuda" for o in outs):
            self.copies.append(str(func))
        return out


def _state() -> list[torch.Tensor]:
    return [torch.zeros(8, device="cuda") for _ in range(4)]


def test_the_fused_adam_step_copies_nothing_from_the_host():
    with FakeTensorMode(allow_non_fake_inputs=True):
        p, g, m, v = _state()
        with HostToDevice() as seen:
            fused_adam_(p, g, m, v, 3, lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8,
                        weight_decay=0.01, decoupled=True)
    assert seen.copies == []


def test_lazy_adams_row_update_copies_nothing_from_the_host():
    group = {"betas": (0.9, 0.99), "nesterov": False, "lr": 0.1, "weight_decay": 0.0,
             "eps": 1e-8}
    with FakeTensorMode(allow_non_fake_inputs=True):
        w, g, m, v = _state()
        with HostToDevice() as seen:
            _adam_math(w, g, m, v, 5, group)
    assert seen.copies == []


def test_the_step_tensor_still_gives_torchs_update():
    """torch.full in place of torch.tensor: the same step count reaches the kernel."""
    p, g, m, v = (torch.full((8,), 0.5), torch.linspace(-1, 1, 8), torch.zeros(8), torch.zeros(8))
    ref = torch.nn.Parameter(p.clone())
    ref.grad = g.clone()
    opt = torch.optim.AdamW([ref], lr=0.1, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01,
                            fused=True)
    for step in (1, 2):
        opt.step()
        fused_adam_(p, g, m, v, step, lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8,
                    weight_decay=0.01, decoupled=True)
    assert torch.equal(p, ref.detach())
