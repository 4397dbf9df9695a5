"""Argument checks shared by every optimizer and helper that takes a rate, a norm or a count.

One rule per kind of value, one message shape: ``"<owner>: invalid <name>=<value> (must be ...)"``
(ValueError), or ``"<owner>: <name> must be a number"`` (TypeError) for a value of the wrong type.
NaN is refused everywhere a bound is checked.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch


def check_number(owner: str, name: str, value: Any, low: float, *, strict: bool = False,
                 high: float | None = None) -> float:
    """``value`` as a float; TypeError unless a real number, ValueError unless ``>= low``
    (``> low`` with ``strict``) and, with ``high``, ``< high``. A one-element tensor (torch
    optimizers accept a tensor ``lr``) is checked by its value."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}: {name} must be a number, got {type(value).__name__}")
    number = float(value)
    below = number <= low if strict else number < low
    if below or (high is not None and number >= high) or math.isnan(number):
        bound = f"> {low}" if strict else f">= {low}"
        bound += f" and < {high}" if high is not None else ""
        raise ValueError(f"{owner}: invalid {name}={value} (must be {bound})")
    return number


def check_count(owner: str, name: str, value: Any, low: int = 1) -> int:
    """``value`` as an int; TypeError unless an integer, ValueError unless ``>= low``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{owner}: {name} must be an integer, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{owner}: invalid {name}={value} (must be >= {low})")
    return int(value)


def check_betas(owner: str, betas: Any) -> tuple[float, float]:
    """Adam's ``betas``: two numbers in [0, 1)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{owner}: betas must be two numbers, got {betas!r}")
    return tuple(check_number(owner, f"betas[{i}]", b, 0.0, high=1.0)  # type: ignore[return-value]
                 for i, b in enumerate(betas))


def check_adam_group(owner: str, group: dict[str, Any]) -> None:
    """The Adam hyper-parameters present in ``group`` (a param group or the defaults)."""
    if "lr" in group:
        check_number(owner, "lr", group["lr"], 0.0)
    if "betas" in group:
        group["betas"] = check_betas(owner, group["betas"])
    for key in ("eps", "weight_decay"):
        if key in group:
            check_number(owner, key, group[key], 0.0)


def check_clip_args(owner: str, max_norm: Any, norm_type: Any) -> None:
    """Gradient clipping's ``max_norm`` (>= 0) and ``norm_type`` (> 0, inf allowed)."""
    check_number(owner, "max_norm", max_norm, 0.0)
    check_number(owner, "norm_type", norm_type, 0.0, strict=True)
