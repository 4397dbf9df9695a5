"""``FTRL``: FTRL-proximal (McMahan et al., 2013), row-sparse, where the table lives.

The update of the reference framework's ``nn.FTRL`` documentation, per element, with accumulator
``m`` (starts at ``initial_accum``), linear term ``u`` (starts at 0), ``p = lr_power`` and
``α = learning_rate``:

    m' = m + g²
    u' = u + g - (m'^(-p) - m^(-p)) / α · w
    w' = (sign(u')·l1 - u') / (m'^(-p) / α + 2·l2)   if |u'| > l1,   else 0

``weight_decay`` adds ``weight_decay · w`` to the gradient first. For a sparse gradient only the
rows present are touched (gathered, updated with vectorised torch ops over all host cores,
scattered back); dense gradients update every element. L1 makes weights exactly zero, which is
why FTRL suits the wide (linear) part of Wide&Deep models.

The learning rate is stored as the group's ``"lr"`` so torch's LR schedulers drive it; a param
group may give it as ``"lr"`` or ``"learning_rate"``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from hetero.optim.lazy_adam import RowSparseOptimizer, check_number, sparse_rows


def _ftrl_math(w: torch.Tensor, g: torch.Tensor, accum: torch.Tensor, linear: torch.Tensor,
               group: dict[str, Any], scratch: list[torch.Tensor]) -> None:
    """One FTRL step on (gathered rows of) a weight and its accumulators. ``w`` and ``linear``
    are updated in place; the new accumulator is left in ``scratch[0]`` and ``accum`` is
    clobbered. ``scratch``: two tensors shaped like ``w``, so the update allocates nothing."""
    lr, power, l1, l2 = group["lr"], group["lr_power"], group["l1"], group["l2"]
    new_accum, scale = scratch
    if group["weight_decay"]:
        g = torch.add(g, w, alpha=group["weight_decay"], out=scale)
    torch.addcmul(accum, g, g, out=new_accum)
    linear.add_(g)  # g (which may live in ``scale``) is not needed after this
    if power == -0.5:  # the usual case: square roots instead of pows
        old_scale, new_scale = accum.sqrt_(), torch.sqrt(new_accum, out=scale)
    else:
        old_scale, new_scale = accum.pow_(-power), torch.pow(new_accum, -power, out=scale)
    sigma = old_scale.neg_().add_(new_scale).div_(lr)  # (m'^-p - m^-p) / α, in ``accum``
    linear.sub_(sigma.mul_(w))
    quadratic = new_scale.div_(lr).add_(2 * l2)
    torch.sign(linear, out=w).mul_(l1).sub_(linear).div_(quadratic)  # (sign(u)·l1 - u) / q
    if l1 > 0:  # where |u| <= l1 the weight is exactly 0 (with l1 = 0 the formula gives 0)
        w.masked_fill_(linear.abs() <= l1, 0.0)


class FTRL(RowSparseOptimizer):
    """FTRL-proximal with lazy row updates for sparse gradients; see the module doc.

    Args:
        params: parameters or param-group dicts (per-group overrides of every argument work).
        initial_accum: starting value of the accumulator (>= 0).
        learning_rate: α (> 0).
        lr_power: p (<= 0); -0.5 is the classic FTRL.
        l1, l2: regularization strengths (>= 0).
        weight_decay: L2 added to the gradient (>= 0).

    State per parameter: ``accum`` and ``linear``, full-size and where the parameter lives.
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
                 initial_accum: float = 0.1, learning_rate: float = 0.001,
                 lr_power: float = -0.5, l1: float = 0.0, l2: float = 0.0,
                 weight_decay: float = 0.0) -> None:
        defaults = dict(initial_accum=initial_accum, lr=learning_rate, lr_power=lr_power, l1=l1,
                        l2=l2, weight_decay=weight_decay)
        self._check_group(defaults)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; ``learning_rate`` is accepted as another name for ``lr``."""
        if "learning_rate" in param_group:
            if "lr" in param_group:
                raise ValueError("FTRL: a param group gives both lr and learning_rate")
            param_group = dict(param_group)
            param_group["lr"] = param_group.pop("learning_rate")
        super().add_param_group(param_group)

    def _check_group(self, group: dict[str, Any]) -> None:
        check_number("FTRL", "initial_accum", group["initial_accum"], 0.0)
        check_number("FTRL", "learning_rate", group["lr"], 0.0, strict=True)
        check_number("FTRL", "l1", group["l1"], 0.0)
        check_number("FTRL", "l2", group["l2"], 0.0)
        check_number("FTRL", "weight_decay", group["weight_decay"], 0.0)
        check_number("FTRL", "lr_power", group["lr_power"], float("-inf"))
        if group["lr_power"] > 0:
            raise ValueError(f"FTRL: invalid lr_power={group['lr_power']} (must be <= 0)")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, p in self._params_with_grad():
            state = self.state[p]
            if not state:
                state["accum"] = torch.full_like(p, group["initial_accum"],
                                                 memory_format=torch.preserve_format)
                state["linear"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            accum, linear = state["accum"], state["linear"]
            if not p.grad.is_sparse:
                scratch = [torch.empty_like(p) for _ in range(2)]
                _ftrl_math(p, p.grad, accum, linear, group, scratch)
                accum.copy_(scratch[0])
                continue
            rows, g, row_shape = sparse_rows(p.grad, p)
            if rows.numel() == 0:
                continue
            full = [t.view(-1, *row_shape) for t in (p, accum, linear)]
            w, a, u, new_accum, scale = self.row_buffers(full[0], 5, rows.numel())
            for whole, part in zip(full, (w, a, u), strict=True):
                torch.index_select(whole, 0, rows, out=part)
            _ftrl_math(w, g.to(p.dtype), a, u, group, [new_accum, scale])
            for whole, part in zip(full, (w, new_accum, u), strict=True):
                whole.index_copy_(0, rows, part)
        return loss
