"""A step's update guarded by its loss being finite, without the host waiting for the device.

The recipes' promise (``trainer.on_nonfinite_loss``): a NaN/Inf loss never reaches the weights;
``stop`` ends the run, naming the step, before any checkpoint holds what followed it; ``skip``
skips that update on every rank alike. Deciding on the host means reading the loss before the
update: on an accelerator that read drains the stream once per step, so the next step's work
cannot be queued while this one computes.

Where the optimizer can skip an update on the device (torch's fused Adam/AdamW/SGD take a
``found_inf`` flag, as ``torch.amp.GradScaler`` hands them: the kernel leaves weights, moments
and the step count as they were when it is 1), the flag never visits the host before the
update: the update runs with it, and the flag is copied to the host without waiting
(:func:`foundation.device.to_host_async`). The host reads it a step later, after the next step's
work is queued (its copy finished long before), and before any checkpoint or the end of the
run: ``stop`` raises for the step there, ``skip`` records it. Elsewhere (other optimizers, the
loss scaler's fp16 path, sharded DTensor weights, which the flag as a plain tensor cannot meet
in one kernel) the flag is read before the update, as before.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor

import foundation.device as hd

log = logging.getLogger(__name__)


class NonFiniteLossError(FloatingPointError):
    """The loss of a step was NaN or Inf (with ``trainer.on_nonfinite_loss=stop``)."""


def skips_on_device(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor],
                    scaled: bool) -> bool:
    """Whether ``optimizer`` can take the finiteness flag on the device: a torch optimizer with
    a fused step over plain tensors, and no loss scaler deciding about the step already."""
    return (not scaled and getattr(optimizer, "_step_supports_amp_scaling", False)
            and all(group.get("fused") for group in optimizer.param_groups)
            and not any(isinstance(p, DTensor) for p in params))


class FiniteGuard:
    """The update of each step guarded by its mean loss (module docstring). ``policy``:
    ``"stop"`` or ``"skip"``."""

    def __init__(self, policy: str, skipped_steps: list[int]) -> None:
        self.policy = policy
        self.skipped_steps = skipped_steps  # the recipe's list, appended to
        #: the last masked step: (step, its flag on the host, the copy's event), unread
        self._pending: tuple[int, torch.Tensor, torch.Event | hd.HostEvent] | None = None

    def step(self, step: int, mean: torch.Tensor, update: Callable[[], None],
             optimizer: torch.optim.Optimizer, on_device: bool) -> None:
        """Run ``update`` for ``step`` unless ``mean`` (the loss over all ranks) is NaN/Inf.
        ``on_device``: :func:`skips_on_device`'s answer for ``optimizer``."""
        self.settle()  # the previous step's flag: its copy finished while this step ran
        if not on_device:
            if bool(torch.isfinite(mean)):  # the step's one host read, before the update
                update()
            else:
                self._non_finite(step, mean.item())
            return
        found = torch.isfinite(mean).logical_not().float()
        optimizer.found_inf = found  # type: ignore[attr-defined]  # GradScaler's hand-off
        try:
            update()
        finally:
            del optimizer.found_inf  # type: ignore[attr-defined]
        host, done = hd.to_host_async(mean.detach().reshape(()))
        self._pending = (step, host, done)

    def settle(self) -> None:
        """Read the last masked step's loss (no wait in steady state: its copy is done);
        raise or record as the policy says. Call before a checkpoint and at the run's end."""
        if self._pending is None:
            return
        step, host, done = self._pending
        self._pending = None
        done.synchronize()
        value = float(host)
        if not math.isfinite(value):
            self._non_finite(step, value)

    def _non_finite(self, step: int, value: float) -> None:
        if self.policy != "skip":
            raise NonFiniteLossError(
                f"step {step}: the loss is {value} (non-finite); stopping before the update so "
                f"that no checkpoint holds it. A corrupt checkpoint or a learning rate far too "
                f"high are the usual causes; trainer.on_nonfinite_loss=skip skips such steps")
        log.warning("step %d: the loss is %s; update skipped on every rank "
                    "(trainer.on_nonfinite_loss=skip)", step, value)
        self.skipped_steps.append(step)
