"""``apply_offload``: a model (and its optimizer) made to follow an :class:`OffloadPolicy`.

The steps, in the order that keeps each one's assumptions: activation offload wraps the layers'
forwards (a layer's saved tensors then go to host memory whatever its weights do); parameter
offload moves the weights home to the host and hooks the layers; the optimizer is built last,
over the parameters as they then are (host tensors under parameter offload, the model's device
tensors otherwise).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from foundation.layers import unit_modules
from hetero.offload.activations import ActivationOffload, offload_activations
from hetero.offload.params import ParamOffload
from hetero.offload.policy import OffloadPolicy


@dataclasses.dataclass
class Offloaded:
    """What :func:`apply_offload` set up: the policy, the parameter offload (or None), the
    activation offloader (or None) and the layers they act on."""

    policy: OffloadPolicy
    params: ParamOffload | None
    activations: ActivationOffload | None
    layers: list[nn.Module]

    def optimizer(self, params: Iterable[Any], **adamw: Any) -> torch.optim.Optimizer:
        """The AdamW the policy asks for over ``params`` (``adamw``: its arguments, as for
        ``torch.optim.AdamW``; ``param_dtype``, ``kernel``, ``host_threads`` ... pass on to
        :class:`hetero.optim.OffloadAdamW`): torch's AdamW where the state stays on the device,
        ``OffloadAdamW`` with the policy's ratio where it goes to the host, ``DiskAdamW`` under
        the policy's path where it goes to disk."""
        if self.policy.optimizer == "device":
            return torch.optim.AdamW(params, **adamw)
        if self.policy.optimizer == "disk":
            from hetero.offload.disk_adam import DiskAdamW

            return DiskAdamW(params, path=str(self.policy.path), **adamw)
        from hetero.optim import OffloadAdamW  # the optimizers' package imports offload's

        return OffloadAdamW(params, host_ratio=self.policy.ratio, **adamw)


def apply_offload(model: nn.Module, policy: OffloadPolicy, *, device: Any = "device",
                  compute_dtype: torch.dtype | None = None,
                  layers: list[nn.Module] | None = None,
                  init: Callable[[str, torch.Tensor], None] | None = None) -> Offloaded:
    """Make ``model`` follow ``policy`` (module docstring). ``layers``: the modules offloaded
    one at a time (default: :func:`foundation.layers.unit_modules`, the layers of the model's
    layer stacks); ``compute_dtype``: the device copies' dtype under parameter offload.
    ValueError, before any change, when the policy offloads something and the model has no
    layers to do it by."""
    if not isinstance(policy, OffloadPolicy):
        raise TypeError(f"apply_offload: expected an OffloadPolicy, got "
                        f"{type(policy).__name__}")
    found = unit_modules(model) if layers is None else list(layers)
    if not found and (policy.params != "device" or policy.activations == "host"):
        raise ValueError(f"apply_offload: {type(model).__name__} has no layer stack "
                         f"(nn.ModuleList / nn.Sequential) to offload layer by layer; pass "
                         f"layers=[...]")
    activations = None
    if policy.activations == "host":
        activations = ActivationOffload()
        for layer in found:
            offload_activations(layer, activations)
    params = None
    if policy.params != "device":
        params = ParamOffload(model, device=device, prefetch=policy.prefetch,
                              compute_dtype=compute_dtype, units=found,
                              disk_path=policy.path if policy.params == "disk" else None,
                              init=init)
    return Offloaded(policy, params, activations, found)
