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

from hetero.compat import tensor_version
from hetero.optim.validate import check_clip_args


class HostGradients:
    """Mixin for :class:`~hetero.optim.OffloadAdam`; uses its ``_grads`` (GradOffloader),
    ``_all_slots()``, ``_overlap`` and ``_grad_scale``."""

    _norm_cache: dict

    def _collect_grads(self) -> None:
        """Take gradients assigned to ``.grad`` of offloaded parameters; wait for all copies."""
        slots = self._all_slots()
        for slot in slots:  # check everything before moving anything
            grad = slot.param.grad
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
                grad, slot.param.grad = slot.param.grad, None
                self._grads.add(slot, grad)
        self._grads.wait_all()

    def _host_grads(self) -> list[torch.Tensor]:
        grads = []
        for slot in self._all_slots():
            if slot.in_place:
                if slot.param.grad is not None:
                    grads.append(slot.param.grad)
            elif (source := self._grads.source(slot)) is not None:
                grads.append(slot.arena.view(source, slot.index))
        return grads

    def _raw_norm(self, norm_type: float) -> torch.Tensor:
        """Norm of the host gradients as they landed (before ``_grad_scale``), cached."""
        self._collect_grads()
        grads = self._host_grads()
        key = (float(norm_type), self._grads.generation,
               tuple((id(g), tensor_version(g)) for g in grads))
        if key not in self._norm_cache:
            norms = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads]
            total = (torch.linalg.vector_norm(torch.stack(norms), norm_type) if norms
                     else torch.zeros(()))
            self._norm_cache = {key: total}
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
