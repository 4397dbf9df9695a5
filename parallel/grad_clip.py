"""Gradient clipping over a model whose gradients are partly sharded ``DTensor``s (FSDP2's, or
experts sharded over ``ep``) and partly plain replicated tensors, or DTensors on several meshes
(semi-auto with modules placed on the host: the device mesh and its host twin; a semi-auto model
and its MoE experts' ``ep`` mesh).

``torch.nn.utils.clip_grad_norm_`` refuses that mix (``_foreach_norm`` "got mixed torch.Tensor
and DTensor"; "All operands in aten.stack must have the same mesh"), so the norm is taken per
kind — each mesh's DTensors' global norm through DTensor (its ``full_tensor()`` reduces over the
mesh), the replicated part locally (every rank holds the same reduced gradients) — and combined;
every kind is then scaled by the same factor.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.nn.utils import get_total_norm

from foundation.compat import foreach_mul_
from foundation.validate import check_clip_args


def _norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    total = get_total_norm(grads, norm_type)
    return total.full_tensor() if isinstance(total, DTensor) else total


def group_norms(grads: list[torch.Tensor], norm_type: float = 2.0) -> list[torch.Tensor]:
    """One norm per kind of gradient in ``grads``: per mesh of its DTensors (the global norm of
    the sharded gradients: one collective per mesh, not per parameter) and per device of its
    plain tensors (local). Each norm stays where its gradients are: nothing is read by the host.
    """
    kinds: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        kinds.setdefault(g.device_mesh if isinstance(g, DTensor) else g.device, []).append(g)
    return [_norm(kind, norm_type) for kind in kinds.values()]


def scale_(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply every gradient (a DTensor's local part) by ``coef``, moved once per device."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        t = g.to_local() if isinstance(g, DTensor) else g
        by_device.setdefault(t.device, []).append(t)
    for device, tensors in by_device.items():
        factor = coef.to(device)
        dense = [t for t in tensors if not t.is_sparse]
        if dense:
            foreach_mul_(dense, factor)
        for t in tensors:
            if t.is_sparse:
                t.mul_(factor)


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a mix of sharded and plain gradients; returns the
    global total norm (a plain tensor, the same on every rank). A negative or NaN ``max_norm``
    is refused: torch's would turn the update into an ascent."""
    check_clip_args("clip_grad_norm_", max_norm, norm_type)
    grads = [p.grad for p in params if p.grad is not None]
    norms = group_norms(grads, norm_type)
    if not norms:
        return torch.zeros(())
    total = get_total_norm(norms, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite "
                           f"({total.item()}), so it cannot be clipped")
    scale_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total
