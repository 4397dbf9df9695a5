"""``LazyAdam``: Adam that updates only the rows a sparse gradient touches, where the table lives.

For a row-sparse gradient (``hetero.nn.EmbeddingLookup``, ``nn.Embedding(sparse=True)``) only the
rows present are updated: their two moments and their weights, with the bias correction of the
*global* step (MindSpore's LazyAdam). Untouched rows keep their weights and moments exactly; that
is what makes it "lazy" and what lets a 10 M-row table train at the cost of the rows in a batch.
Dense gradients take the ordinary Adam update, equal to ``torch.optim.Adam``.

How: duplicates are coalesced first (a gradient from ``EmbeddingLookup`` already is), the touched
rows of weight and moments are gathered, updated by torch's fused Adam kernel
(``torch.optim.adam.adam(fused=True)``: vectorised, parallel over all host cores) and scattered
back. ``torch.optim.SparseAdam`` does the same arithmetic with a dozen sparse-tensor operations and
re-coalesces every step; ``benchmarks/embedding.py`` compares the two.

Conventions: ``eps`` is added after the bias correction of the second moment, as in
``torch.optim.Adam`` (MindSpore adds it before; the two differ only in how eps is scaled).
``nesterov`` (MindSpore's ``use_nesterov``) uses ``beta1 * m_t + (1 - beta1) * g`` as the
numerator (MindSpore/TF's form).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.adam import adam

from foundation.validate import check_adam_group
from hetero.nn.row_blocks import zeros_for_state
from hetero.optim.row_sparse import RowSparseOptimizer, rename_alias


def _adam_math(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int,
               group: dict[str, Any]) -> None:
    """One Adam step, in place, on (gathered rows of) a weight and its moments."""
    beta1, beta2 = group["betas"]
    if not group["nesterov"]:  # torch's own fused kernel; it counts from the step before
        before = torch.full((), float(step - 1), device=w.device)  # a fill: no host copy
        adam([w], [g], [m], [v], [], [before], fused=True, amsgrad=False, beta1=beta1,
             beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
             maximize=False)
        return
    if group["weight_decay"]:
        g = g.add(w, alpha=group["weight_decay"])
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    numerator = m.mul(beta1).add_(g, alpha=1 - beta1)
    denom = v.sqrt().div_(math.sqrt(1 - beta2**step)).add_(group["eps"])
    w.addcdiv_(numerator, denom, value=-group["lr"] / (1 - beta1**step))


class LazyAdam(RowSparseOptimizer):
    """Adam with lazy (touched-rows-only) updates for sparse gradients; see the module doc.

    Args:
        params: parameters or param-group dicts (per-group overrides of every argument work).
        lr, betas, eps, weight_decay: as ``torch.optim.Adam`` (L2 decay, added to the gradient
            of the touched rows only).
        nesterov: Nesterov momentum in the numerator (``use_nesterov``, MindSpore's name, is
            accepted too).

    State per parameter (``state_dict`` as ``torch.optim.Adam``'s): ``step`` (global),
    ``exp_avg``, ``exp_avg_sq``, full-size and where the parameter lives.
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
                 lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, nesterov: bool | None = None, *,
                 use_nesterov: bool | None = None) -> None:
        flags = {k: v for k, v in (("nesterov", nesterov), ("use_nesterov", use_nesterov))
                 if v is not None}
        defaults = rename_alias("LazyAdam", dict(lr=lr, betas=betas, eps=eps,
                                                 weight_decay=weight_decay, **flags),
                                "use_nesterov", "nesterov")
        defaults.setdefault("nesterov", False)
        self._check_group(defaults)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; ``use_nesterov`` is accepted as another name for ``nesterov``."""
        super().add_param_group(rename_alias("LazyAdam", param_group, "use_nesterov", "nesterov"))

    def _check_group(self, group: dict[str, Any]) -> None:
        check_adam_group("LazyAdam", group)
        if not isinstance(group["nesterov"], bool):
            raise TypeError(f"LazyAdam: nesterov must be a bool, got "
                            f"{type(group['nesterov']).__name__}")

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Groups loaded from ``torch.optim.Adam`` or an older LazyAdam get this one's keys."""
        super().__setstate__(state)
        for group in self.param_groups:
            if "use_nesterov" in group:
                group["nesterov"] = group.pop("use_nesterov")
            group.setdefault("nesterov", False)

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
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = zeros_for_state(p, "exp_avg")  # where the table says
                state["exp_avg_sq"] = zeros_for_state(p, "exp_avg_sq")
            m, v = state["exp_avg"], state["exp_avg_sq"]
            step = int(state["step"].item()) + 1
            if not p.grad.is_sparse:
                _adam_math(p, p.grad, m, v, step, group)
            else:  # the gradient is read (and checked) before any state changes
                def update(g, w, m_rows, v_rows, step=step, group=group):
                    _adam_math(w, g, m_rows, v_rows, step, group)
                    return w, m_rows, v_rows
                self.update_rows(p.grad, (p, m, v), update)
            state["step"] += 1
        return loss
