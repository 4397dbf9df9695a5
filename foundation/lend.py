"""``LendDuringForward``: a module computes with copies of some of its own tensors.

Hook placement (``hetero.place(mode="hooks")``) and semi-auto's host boundaries both meet a
parameter registered in two modules that run on different devices (a tied embedding and output
head): it has one home, and the module elsewhere must compute with a differentiable copy of it,
so that the gradients of both uses sum into the one parameter. For the duration of that module's
forward its registry holds the copy; afterwards (also when the forward raises) the original is
put back, so ``parameters()``, ``state_dict()`` and optimizers never see the copy.

Why by hand: torch's ``nn.utils.stateless.functional_call`` swaps tensors for one call of the
*root* module, not for a submodule's forward inside the root's, and its parametrizations
(``register_parametrization``) replace the parameter's registration for good.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class LendDuringForward:
    """Hooks on ``module`` that put ``copy(t)`` in place of each of its own parameters or buffers
    ``names`` for the duration of its forward (the module docstring)."""

    def __init__(self, module: nn.Module, names: list[str],
                 copy: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.names, self.copy = names, copy
        self.saved: dict[str, torch.Tensor] = {}
        module.register_forward_pre_hook(self.lend)
        module.register_forward_hook(self.give_back, always_call=True)

    @staticmethod
    def _registry(module: nn.Module, name: str) -> dict[str, Any]:
        # the registry itself: setattr would refuse a plain tensor in a parameter's slot
        return module._parameters if name in module._parameters else module._buffers

    def lend(self, module: nn.Module, args: Any) -> None:
        for name in self.names:
            registry = self._registry(module, name)
            self.saved[name] = registry[name]
            registry[name] = self.copy(registry[name])

    def give_back(self, module: nn.Module, args: Any, output: Any) -> None:
        for name, tensor in self.saved.items():
            self._registry(module, name)[name] = tensor
        self.saved = {}
