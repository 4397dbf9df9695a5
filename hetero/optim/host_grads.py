"""The gradient side of the offloaded optimizers: collecting, norms, clipping, loss-scale undo.

After backward the gradients of offloaded parameters are in host buffers, not in ``.grad``, so
``torch.nn.utils.clip_grad_norm_`` and ``torch.amp.GradScaler`` cannot see them. These methods do
their jobs on the host copies. Scaling (the loss-scale undo, the clip factor) is never applied
with a pass of its own: it accumulates in ``_grad_scale`` and the update kernel multiplies each
gradient by it as it reads it. One norm pass (cached until the gradients change) serves both the
clipping and the fp16 overflow check.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from foundation.collective_check import check as check_collective
from foundation.compat import tensor_version
from foundation.validate import check_clip_args
from hetero.optim.param_slots import DTensor, ParamSlot


def _norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm of ``grads`` as a host tensor: reduced per device first, so a group kept on the
    accelerator (``offload=False``) costs one transfer, not one per gradient."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(
            torch.linalg.vector_norm(g, norm_type, dtype=torch.float32))
    norms = [torch.linalg.vector_norm(torch.stack(n), norm_type).cpu()
             for n in by_device.values()]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type) if norms else torch.zeros(())


def _global_norm(grads: list[tuple[ParamSlot, torch.Tensor | None]], norm_type: float
                 ) -> torch.Tensor:
    """The norm over whole parameters. A sharded parameter's other slices are on other ranks
    (optimizer parallel), so its part is reduced over the mesh dimensions that shard it: every
    rank joins those reductions for every sharded parameter, with or without a gradient."""
    plain = [g for slot, g in grads if g is not None and not isinstance(slot.param, DTensor)]
    parts = [_norm(plain, norm_type)]
    sharded: dict[tuple, tuple[object, list[int], list[torch.Tensor]]] = {}
    for slot, g in grads:
        if isinstance(slot.param, DTensor):
            mesh = slot.param.device_mesh
            dims = [i for i, p in enumerate(slot.param.placements) if p.is_shard()]
            entry = sharded.setdefault((id(mesh), *dims), (mesh, dims, []))
            if g is not None:
                entry[2].append(g)
    for mesh, dims, group in sharded.values():
        part = _norm(group, norm_type)
        inf = norm_type == float("inf")
        if not inf:
            part = part.pow(norm_type)
        for dim in dims:
            check_collective("all_reduce", part, mesh.get_group(dim), what="gradient norm",
                             params=(int(inf),))
            dist.all_reduce(part, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM,
                            group=mesh.get_group(dim))
        parts.append(part if inf else part.pow(1.0 / norm_type))
    return _norm(parts, norm_type)


class HostGradients:
    """Mixin for :class:`~hetero.optim.OffloadAdam`; uses its ``_grads`` (GradOffloader),
    ``_all_slots()``, ``_overlap`` and ``_grad_scale``."""

    _norm_cache: dict

    def _collect_grads(self) -> None:
        """Take gradients assigned to ``.grad`` of offloaded parameters; wait for all copies."""
        slots = self._all_slots()
        for slot in slots:  # check everything before moving anything
            grad = slot.grad
            if grad is None:
                continue
            if slot.count and self._overlap and not slot.in_place:
                raise RuntimeError(
                    f"a parameter of shape {tuple(slot.param.shape)} got its gradient through "
                    f"backward and then again in .grad (torch DDP writes its reduced gradients "
                    f"there after backward): build the optimizer with overlap_backward=False "
                    f"under DDP, or either assign .grad or call backward, not both")
            if grad.layout != torch.strided:
                raise ValueError(f"a parameter of shape {tuple(slot.param.shape)} received a "
                                 f"{grad.layout} gradient: OffloadAdam needs dense gradients")
        for slot in slots:
            if not slot.in_place and slot.param.grad is not None:
                grad, slot.param.grad = slot.grad, None
                self._grads.add(slot, grad)
        self._grads.wait_all()

    def _host_grads(self) -> list[tuple[ParamSlot, torch.Tensor | None]]:
        """Every slot with its host gradient (None when it has none)."""
        grads = []
        for slot in self._all_slots():
            if slot.in_place:
                grads.append((slot, slot.grad))
            else:
                source = self._grads.source(slot)
                grads.append((slot, None if source is None
                              else slot.arena.view(source, slot.index)))
        return grads

    def _raw_norm(self, norm_type: float) -> torch.Tensor:
        """Norm of the host gradients as they landed (before ``_grad_scale``), cached."""
        self._collect_grads()
        grads = self._host_grads()
        key = (float(norm_type), self._grads.generation,
               tuple((id(g), tensor_version(g)) for _, g in grads if g is not None))
        if key not in self._norm_cache:
            self._norm_cache = {key: _global_norm(grads, float(norm_type))}
        return self._norm_cache[key]

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """Total norm of the gradients the next ``step()`` will apply (host FP32 tensor)."""
        return self._raw_norm(norm_type) * self._grad_scale

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` on the host gradients; returns the total norm.

        The clip factor is folded into the update kernel (no extra pass over the gradients).
        A negative or NaN ``max_norm`` is refused (it would turn the update into an ascent).
        """
        check_clip_args(type(self).__name__, max_norm, norm_type)
        total = self.grad_norm(norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is "
                               f"non-finite ({total.item()}), so it cannot be clipped")
        clip = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        self._grad_scale *= float(clip)
        return total

    def scale_grads_(self, factor: float) -> None:
        """Multiply the gradients the next ``step()`` applies by ``factor`` (lazily)."""
        self._grad_scale *= factor

    def grads_are_finite(self) -> bool:
        """False when any host gradient holds Inf/NaN (the check reads the host copies)."""
        return bool(torch.isfinite(self._raw_norm(2.0)))
