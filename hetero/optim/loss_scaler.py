"""Dynamic loss scaling for fp16 device weights, checked on the host copies of the gradients.

fp16 gradients underflow without a loss scale and overflow with too large a one. The scaler
multiplies the loss by ``scale`` before backward; at ``step`` it undoes the scale (folded into the
host update, no extra pass) after checking the *host* copies of the gradients for Inf/NaN — one
pass over them that also serves gradient clipping. An overflowing step is skipped (gradients
dropped, nothing touches the FP32 master) and the scale backs off; ``growth_interval`` clean steps
in a row grow it again. bf16 has fp32's exponent range and needs no scaler.

The API follows ``torch.amp.GradScaler`` (``scale``, ``unscale_``, ``step``, ``update``,
``get_scale``, ``state_dict``). torch's scaler cannot be used here: it inspects ``.grad`` on the
device, which the offloaded optimizer has already moved to the host.
"""

from __future__ import annotations

from typing import Any

import torch

from hetero.optim.offload_adam import OffloadAdam


class LossScaler:
    """``GradScaler``-like dynamic loss scaling for :class:`~hetero.optim.OffloadAdam`."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 enabled: bool = True) -> None:
        if not init_scale > 0:
            raise ValueError(f"LossScaler: init_scale must be > 0, got {init_scale}")
        if not growth_factor > 1.0:
            raise ValueError(f"LossScaler: growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"LossScaler: backoff_factor must be in (0, 1), got {backoff_factor}")
        if not (isinstance(growth_interval, int) and growth_interval >= 1):
            raise ValueError(f"LossScaler: growth_interval must be an int >= 1, "
                             f"got {growth_interval!r}")
        self._enabled = enabled
        self._scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = growth_interval
        self._growth_tracker = 0
        self._found_inf: bool | None = None   # this iteration's check, None until made
        self.skipped_steps = 0

    def is_enabled(self) -> bool:
        return self._enabled

    def get_scale(self) -> float:
        """The current loss scale (1.0 when disabled)."""
        return self._scale if self._enabled else 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale``: call ``.backward()`` on this."""
        return loss * self._scale if self._enabled else loss

    @staticmethod
    def _check(optimizer: Any) -> OffloadAdam:
        if not isinstance(optimizer, OffloadAdam):
            raise TypeError(f"LossScaler drives hetero.optim.OffloadAdam/OffloadAdamW, got "
                            f"{type(optimizer).__name__}; use torch.amp.GradScaler for torch "
                            f"optimizers")
        return optimizer

    def unscale_(self, optimizer: OffloadAdam) -> None:
        """Undo the scale on ``optimizer``'s gradients (lazily) and check them for Inf/NaN.

        Call it before ``optimizer.clip_grad_norm_`` so that clipping sees true norms.
        """
        opt = self._check(optimizer)
        if not self._enabled:
            return
        if self._found_inf is not None:
            raise RuntimeError("unscale_() has already been called on this optimizer since the "
                               "last update()")
        opt.scale_grads_(1.0 / self._scale)
        self._found_inf = not opt.grads_are_finite()

    def step(self, optimizer: OffloadAdam, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step()`` unless the gradients overflowed; then drop them and skip."""
        opt = self._check(optimizer)
        if not self._enabled:
            return opt.step(*args, **kwargs)
        if self._found_inf is None:
            self.unscale_(opt)
        if self._found_inf:
            opt.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            return None
        return opt.step(*args, **kwargs)

    def update(self, new_scale: float | None = None) -> None:
        """Back off after an overflow; grow after ``growth_interval`` clean steps."""
        if not self._enabled:
            return
        if new_scale is not None:
            self._scale = float(new_scale)
        elif self._found_inf is None:
            raise RuntimeError("LossScaler.update() needs step() (or unscale_()) first in this "
                               "iteration: no overflow check was made")
        elif self._found_inf:
            self._scale *= self._backoff_factor
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self._growth_interval:
                self._scale *= self._growth_factor
                self._growth_tracker = 0
        self._found_inf = None

    def state_dict(self) -> dict[str, Any]:
        """The scale and growth state (``torch.amp.GradScaler``'s keys)."""
        if not self._enabled:
            return {}
        return {"scale": self._scale, "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
                "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self._enabled:
            return
        if not state_dict:
            raise RuntimeError("the loaded LossScaler state dict is empty (saved while disabled)")
        self._scale = float(state_dict["scale"])
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._growth_tracker = int(state_dict["_growth_tracker"])
