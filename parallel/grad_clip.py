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


def _norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    total = get_total_norm(grads, norm_type)
    return total.full_tensor() if isinstance(total, DTensor) else total


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a mix of sharded and plain gradients; returns the
    global total norm (a plain tensor, the same on every rank)."""
    grads = [p.grad for p in params if p.grad is not None]
    kinds: dict[object, list[torch.Tensor]] = {}  # by mesh; plain tensors under None
    for g in grads:
        kinds.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    norms = [_norm(kind, norm_type) for kind in kinds.values()]
    if not norms:
        return torch.zeros(())
    total = get_total_norm(norms, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite "
                           f"({total.item()}), so it cannot be clipped")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    coefs = {}  # one copy of the factor per device
    for g in grads:
        t = g.to_local() if isinstance(g, DTensor) else g
        t.mul_(coefs.setdefault(t.device, coef.to(t.device)))
    return total
