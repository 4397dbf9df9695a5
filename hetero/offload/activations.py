"""Activation offload: what a module saves for backward waits in host memory, not on the device.

``parallel.recompute(module, mode="offload")`` (and ``trainer.recompute=offload``) runs the
module's forward under :class:`ActivationOffload`'s saved-tensor hooks: every tensor autograd
saves inside it (inputs of matrix multiplications, attention scores, norms' statistics) is
copied into host memory as it is saved, so the device keeps none of the module's activations
between forward and backward. In backward the tensors come back, and the *previous* module's
(the next one backward reaches) start coming back at the same time, so the copy of layer i-1
overlaps layer i's gradient computation — the prefetch torch's own ``save_on_cpu`` lacks, which
is why it is not used here: without it, every layer's backward waits for its own copy.

What is kept where it is: parameters (the model holds them anyway; a copy would double them)
and tensors already in host memory. A DTensor is offloaded by its local shard and rebuilt with
the same mesh and placements.

On an accelerator the copies run on a side stream: device-to-host after the compute stream has
produced the tensor (its memory is held for the side stream until the copy is done), host-to-
device into a fresh device tensor that the compute stream waits for by an event. On the host
(no accelerator) "device" and "host" are the same memory: the copy is still made into a separate
storage, so what is measured and tested is the runtime's own cost and bookkeeping.

Versus recompute: offload moves the bytes over the host link instead of recomputing them, so it
costs link bandwidth rather than FLOPs (``parallel.auto``'s memory model prices both).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from foundation import device as hd
from foundation.forward_wrap import wrap_forward
from hetero.local_parts import DTensor, local


@dataclasses.dataclass(eq=False)
class _Call:
    """One forward call of an offloaded module: the tensors it saved, in host memory."""

    # weakly: the autograd graph owns each saved tensor (and, through it, this call), so
    # both are freed as backward releases them, without waiting for the garbage collector
    saved: list[weakref.ref[_Saved]] = dataclasses.field(default_factory=list)
    prefetched: bool = False  # its tensors' way back to the device has started
    asked_previous: bool = False  # it has asked the call before it to come back
    previous: weakref.ref | None = None  # the offloaded call that ran before it in forward


@dataclasses.dataclass(eq=False)
class _Saved:
    """One saved tensor: its host copy and how to rebuild it on the device."""

    host: torch.Tensor
    device: torch.device
    call: _Call
    dtensor: tuple[Any, Any, torch.Size, tuple[int, ...]] | None  # mesh, placements, shape, stride
    back: torch.Tensor | None = None  # the device copy, once on its way back
    ready: Any = None  # the event the device copy is complete at


class ActivationOffload:
    """Saved-tensor hooks that keep a module's activations in host memory (module docstring).

    One instance serves every module offloaded in a model; it remembers the order the calls ran
    in so backward can bring back one call ahead. ``to_host`` / ``kept`` count the tensors
    moved and left in place since :meth:`reset_counts` (a test observes with them that no
    activation stays on the device)."""

    def __init__(self) -> None:
        self._last = threading.local()  # per thread: the call that ran most recently
        self._side: dict[torch.device, torch.Stream] = {}
        self.to_host = 0
        self.kept = 0
        self._alive: weakref.WeakSet[_Saved] = weakref.WeakSet()

    def reset_counts(self) -> None:
        self.to_host = self.kept = 0

    def host_bytes(self) -> int:
        """Bytes of host copies that a live autograd graph still holds."""
        return sum(saved.host.nbytes for saved in list(self._alive))

    def run(self, forward: Any, *args: Any, **kwargs: Any) -> Any:
        """``forward(*args, **kwargs)`` with its saved tensors sent to host memory."""
        call = _Call(previous=getattr(self._last, "call", None))
        self._last.call = weakref.ref(call)
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: self._pack(call, t), self._unpack):
            return forward(*args, **kwargs)

    def _stream(self, device: torch.device) -> torch.Stream:
        if device not in self._side:
            self._side[device] = hd.new_stream(device)
        return self._side[device]

    def _pack(self, call: _Call, tensor: torch.Tensor) -> Any:
        data = local(tensor)
        if not _moves(tensor, data):
            self.kept += 1
            return tensor
        host = hd.pinned_empty(data.shape, data.dtype)
        if data.device.type == "cpu":
            host.copy_(data)
        else:
            side = self._stream(data.device)
            hd.wait_stream(side, hd.current_stream(data.device))
            with hd.stream_scope(side):
                host.copy_(data, non_blocking=True)
            data.record_stream(side)  # the device memory outlives the copy reading it
        spec = ((tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride())
                if isinstance(tensor, DTensor) else None)
        saved = _Saved(host, data.device, call, spec)
        call.saved.append(weakref.ref(saved))
        self._alive.add(saved)
        self.to_host += 1
        return saved

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved  # kept where it was
        call = saved.call
        if not call.asked_previous:  # backward reached this call: the one before it is next
            call.asked_previous = True
            previous = call.previous() if call.previous is not None else None
            if previous is not None:
                self._bring_back(previous)
        self._bring_back(call)
        data = saved.back
        assert data is not None
        if saved.ready is not None:
            compute = hd.current_stream(saved.device)
            saved.ready.wait(compute)
            # made on the side stream, read on this one: its memory is not reused for the side
            # stream's next copies until this stream's work with it is done
            data.record_stream(compute)
            saved.ready = None
        if saved.dtensor is None:
            return data
        mesh, placements, shape, stride = saved.dtensor
        return DTensor.from_local(data, mesh, placements, run_check=False, shape=shape,
                                  stride=stride)

    def _bring_back(self, call: _Call) -> None:
        """Start copying every tensor ``call`` saved back to its device (once)."""
        if call.prefetched:
            return
        call.prefetched = True
        for ref in call.saved:
            saved = ref()
            if saved is None:
                continue  # its node's backward is done already
            if saved.device.type == "cpu":
                saved.back = saved.host  # already a storage of its own: no second copy
                continue
            side = self._stream(saved.device)
            with hd.stream_scope(side):
                saved.back = saved.host.to(saved.device, non_blocking=True)
                saved.ready = hd.new_event(saved.device)
                saved.ready.record(side)


def _moves(tensor: torch.Tensor, data: torch.Tensor) -> bool:
    """Whether a saved ``tensor`` (local part ``data``) goes to host memory: not a parameter
    nor a view of one (the model holds it anyway: ``F.linear`` saves ``weight.t()``, and its
    copy would move every weight to the host in forward and back in backward, for nothing), a
    dense tensor with values, and on the device — on a machine without an accelerator the
    device *is* the host, and the copy is still made (docstring)."""
    if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter):
        return False
    if data.layout != torch.strided:
        return False
    if data.device.type == "meta":
        return False
    return data.device.type != "cpu" or not hd.has_accelerator()


#: the attribute that says how a module's activations are handled (``parallel.recompute``
#: reads and writes the same one, so a module is recomputed or offloaded, never both)
HANDLED_ATTR = "_parallel_recompute"

#: the offloader of modules offloaded without one of their own: one per process, so backward
#: brings back the layer before the one it is in, whichever call offloaded it
SHARED = ActivationOffload()


def offload_activations(module: nn.Module, offload: ActivationOffload | None = None
                        ) -> nn.Module:
    """Keep what ``module`` saves for backward in host memory (module docstring), through
    ``offload`` (default :data:`SHARED`); returns ``module``, its ``forward`` wrapped in place
    (parameters, names, hooks and state dict unchanged)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"offload_activations: expected an nn.Module, got "
                        f"{type(module).__name__}")
    handled = getattr(module, HANDLED_ATTR, None)
    if handled is not None:
        raise ValueError(f"offload_activations: {type(module).__name__}'s activations are "
                         f"already handled (recompute mode {handled!r})")
    offloader = offload or SHARED

    def offloaded(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # inference: nothing is saved anyway
            return forward(*args, **kwargs)
        return offloader.run(forward, *args, **kwargs)

    wrap_forward(module, offloaded)
    setattr(module, HANDLED_ATTR, "offload")
    return module
