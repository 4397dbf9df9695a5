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
why FTRL suits the wide (linear) part of Wide&Deep models. Where ``|u'| <= l1`` the weight is 0
whatever ``l1`` is, as in MindSpore's kernel: with ``initial_accum=0`` an element whose gradients
were all zero has ``m' = u' = 0`` and the formula alone would give 0/0.

The learning rate is torch's ``lr`` (stored as the group's ``"lr"``, so torch's LR schedulers
drive it); the reference's name ``learning_rate`` is accepted for it, as an argument and in a
param group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from foundation.validate import check_number
from hetero.nn.row_blocks import zeros_for_state
from hetero.optim.row_sparse import RowSparseOptimizer, rename_alias


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
    # Where |u| <= l1 the weight is exactly 0; also with l1 = 0, where u = 0 and q may be 0 too.
    w.masked_fill_(linear.abs() <= l1, 0.0)


class FTRL(RowSparseOptimizer):
    """FTRL-proximal with lazy row updates for sparse gradients; see the module doc.

    Args:
        params: parameters or param-group dicts (per-group overrides of every argument work).
        lr: α (> 0); ``learning_rate`` is the same argument under the reference's name.
        initial_accum: starting value of the accumulator (>= 0).
        lr_power: p (<= 0); -0.5 is the classic FTRL.
        l1, l2: regularization strengths (>= 0).
        weight_decay: L2 added to the gradient (>= 0).

    Every argument after ``params`` is keyword-only (``FTRL(p, 0.01)`` would not say which
    value it sets). State per parameter: ``accum`` and ``linear``, full-size and where the
    parameter lives.
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], *,
                 lr: float | None = None, initial_accum: float = 0.1, lr_power: float = -0.5,
                 l1: float = 0.0, l2: float = 0.0, weight_decay: float = 0.0,
                 learning_rate: float | None = None) -> None:
        rates = {k: v for k, v in (("lr", lr), ("learning_rate", learning_rate)) if v is not None}
        defaults = rename_alias("FTRL", dict(initial_accum=initial_accum, lr_power=lr_power, l1=l1,
                                             l2=l2, weight_decay=weight_decay, **rates),
                                "learning_rate", "lr")
        defaults.setdefault("lr", 0.001)
        self._check_group(defaults)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; ``learning_rate`` is accepted as another name for ``lr``."""
        super().add_param_group(rename_alias("FTRL", param_group, "learning_rate", "lr"))

    def _check_group(self, group: dict[str, Any]) -> None:
        check_number("FTRL", "initial_accum", group["initial_accum"], 0.0)
        check_number("FTRL", "lr", group["lr"], 0.0, strict=True)
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
                state["accum"] = zeros_for_state(p, "accum").fill_(group["initial_accum"])
                state["linear"] = zeros_for_state(p, "linear")  # where the table says
            accum, linear = state["accum"], state["linear"]
            if not p.grad.is_sparse:
                scratch = [torch.empty_like(p) for _ in range(2)]
                _ftrl_math(p, p.grad, accum, linear, group, scratch)
                accum.copy_(scratch[0])
                continue

            def update(g, w, a, u, new_accum, scale, group=group):
                _ftrl_math(w, g, a, u, group, [new_accum, scale])
                return w, new_accum, u
            self.update_rows(p.grad, (p, accum, linear), update, scratch=2)
        return loss
