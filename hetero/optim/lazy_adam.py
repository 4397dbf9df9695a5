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
``use_nesterov`` uses ``beta1 * m_t + (1 - beta1) * g`` as the numerator (MindSpore/TF's form).

This module also holds what LazyAdam and FTRL share: reading a sparse gradient as rows
(:func:`sparse_rows`), the ``target`` property and hyper-parameter checks (``RowSparseOptimizer``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.adam import adam

from hetero import device as hd


def check_number(owner: str, name: str, value: Any, low: float, *, strict: bool = False,
                 high: float | None = None) -> None:
    """TypeError unless ``value`` is a real number; ValueError unless it is in range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}: {name} must be a number, got {type(value).__name__}")
    below = value <= low if strict else value < low
    if below or (high is not None and value >= high) or math.isnan(value):
        bound = f"> {low}" if strict else f">= {low}"
        bound += f" and < {high}" if high is not None else ""
        raise ValueError(f"{owner}: invalid {name}={value} (must be {bound})")


def sparse_rows(grad: torch.Tensor, param: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """A sparse COO gradient as (row indices, row values, row shape), duplicates summed.

    Rows are ``param`` viewed as ``[-1, *row_shape]`` (the dims after the sparse ones), so a
    ``[V, D]`` table with a 1-sparse-dim gradient has rows of ``D``; the indices come out sorted
    and distinct. A gradient that already is coalesced is used as it is, flag or not: autograd's
    gradient accumulation drops the flag, and coalescing again would sort it for nothing.
    """
    if not param.is_contiguous():
        raise ValueError("a parameter with a sparse gradient must be contiguous (its rows are "
                         "updated through a view)")
    sparse_dims = grad.sparse_dim()
    row_shape = tuple(param.shape[sparse_dims:])
    indices, values = grad._indices(), grad._values()
    if sparse_dims > 1:  # linear row index over the sparse dims, row-major
        strides = torch.tensor(param.shape[:sparse_dims], device=indices.device)
        strides = torch.cat([strides.flip(0).cumprod(0).flip(0)[1:], strides.new_ones(1)])
        indices = (indices * strides.unsqueeze(1)).sum(0, keepdim=True)
    rows = indices[0]
    if not (grad.is_coalesced() or bool((rows[1:] > rows[:-1]).all())):
        num_rows = param.numel() // math.prod(row_shape)
        merged = torch.sparse_coo_tensor(indices, values, (num_rows, *row_shape),
                                         check_invariants=True).coalesce()
        rows, values = merged.indices()[0], merged.values()
    return rows, values, row_shape


class RowSparseOptimizer(torch.optim.Optimizer):
    """Base of the sparse optimizers: validated groups, ``target``, and row buffers.

    The touched rows of a weight and its state are gathered into buffers that live as long as
    the optimizer and grow to the most rows one step has touched (at most the ids in a batch),
    instead of fresh tensors each step: fresh 100 MB tensors cost their page faults every step,
    which measured as much as the update itself. They are not part of ``state_dict``.
    """

    def row_buffers(self, like: torch.Tensor, count: int, rows: int) -> list[torch.Tensor]:
        """``count`` scratch tensors of ``[rows, *like.shape[1:]]`` on ``like``'s device."""
        key = (like.device, like.dtype, tuple(like.shape[1:]), count)
        buffers = self.__dict__.setdefault("_row_buffers", {})
        held = buffers.get(key)
        if held is None or held[0].shape[0] < rows:
            held = [torch.empty((rows + rows // 4, *like.shape[1:]), dtype=like.dtype,
                                device=like.device) for _ in range(count)]
            buffers[key] = held
        return [b[:rows] for b in held]

    def _check_group(self, group: dict[str, Any]) -> None:
        raise NotImplementedError

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; its hyper-parameters are checked like the constructor's."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._check_group(group)
            for p in group["params"]:
                if p.layout is not torch.strided:
                    raise TypeError(f"{type(self).__name__}: parameters must be dense (strided) "
                                    f"tensors; sparse gradients are fine, got a {p.layout} one")
        except (TypeError, ValueError):
            self.param_groups.pop()  # nothing half-applied
            raise

    @property
    def target(self) -> str:
        """Where the updates run: "CPU" (all parameters in host memory), "DEVICE" (all on the
        accelerator) or "CPU+DEVICE" (each update runs where its parameter lives)."""
        where = {hd.logical_name(p.device) for g in self.param_groups for p in g["params"]}
        if where == {"device"}:
            return "DEVICE"
        return "CPU+DEVICE" if len(where) > 1 else "CPU"

    def _params_with_grad(self) -> Iterable[tuple[dict[str, Any], torch.Tensor]]:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if p.grad.layout not in (torch.strided, torch.sparse_coo):
                        raise TypeError(f"{type(self).__name__}: gradients must be dense or "
                                        f"sparse COO, got {p.grad.layout}")
                    yield group, p


def _adam_math(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int,
               group: dict[str, Any]) -> None:
    """One Adam step, in place, on (gathered rows of) a weight and its moments."""
    beta1, beta2 = group["betas"]
    if not group["use_nesterov"]:  # torch's own fused kernel; it counts from the step before
        before = torch.tensor(float(step - 1), device=w.device)
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
        use_nesterov: Nesterov momentum in the numerator.

    State per parameter (``state_dict`` as ``torch.optim.Adam``'s): ``step`` (global),
    ``exp_avg``, ``exp_avg_sq``, full-size and where the parameter lives.
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
                 lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, use_nesterov: bool = False) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        use_nesterov=use_nesterov)
        self._check_group(defaults)
        super().__init__(params, defaults)

    def _check_group(self, group: dict[str, Any]) -> None:
        check_number("LazyAdam", "lr", group["lr"], 0.0)
        check_number("LazyAdam", "eps", group["eps"], 0.0)
        check_number("LazyAdam", "weight_decay", group["weight_decay"], 0.0)
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"LazyAdam: betas must be two numbers, got {betas!r}")
        for name, beta in zip(("betas[0]", "betas[1]"), betas, strict=True):
            check_number("LazyAdam", name, beta, 0.0, high=1.0)
        group["betas"] = tuple(betas)
        if not isinstance(group["use_nesterov"], bool):
            raise TypeError(f"LazyAdam: use_nesterov must be a bool, got "
                            f"{type(group['use_nesterov']).__name__}")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, p in self._params_with_grad():
            rows = None
            if p.grad.is_sparse:  # read (and check) the gradient before any state changes
                rows, g, row_shape = sparse_rows(p.grad, p)
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            step, m, v = int(state["step"].item()), state["exp_avg"], state["exp_avg_sq"]
            if rows is None:
                _adam_math(p, p.grad, m, v, step, group)
                continue
            if rows.numel() == 0:
                continue
            full = [t.view(-1, *row_shape) for t in (p, m, v)]
            parts = self.row_buffers(full[0], 3, rows.numel())
            for whole, part in zip(full, parts, strict=True):
                torch.index_select(whole, 0, rows, out=part)
            _adam_math(parts[0], g.to(p.dtype), parts[1], parts[2], step, group)
            for whole, part in zip(full, parts, strict=True):
                whole.index_copy_(0, rows, part)
        return loss
