"""Gradients leave the device as backward produces them, in buckets, on a side stream.

A post-accumulate-grad hook on every offloaded parameter hands its fresh ``.grad`` to
:class:`GradOffloader` and sets ``.grad`` to None, so autograd starts a new tensor next time and
the device copy is released as soon as it has been copied. Gradients are collected into a bucket
per device; a full bucket is copied into the pinned landing buffer (``staging``) on a side stream
that first waits for the compute stream, and an event marks its completion. At most
``max_in_flight`` buckets are in flight: a further one makes the autograd thread wait for the
oldest, so the device never holds more than a bucket or two of gradients, however slow the link.
The last, partly filled bucket is sent when backward ends (an autograd engine callback, as
torch's FSDP uses).

DDP's reducer buckets *for all-reduce*; here the buckets are for device→host copies with host
accumulation, which no torch component does, hence this module.

Several backward passes before one ``step()`` accumulate on the host in FP32: when a parameter's
second gradient arrives, the first is folded from ``staging`` into the ``accum`` buffer (waiting
for its copy if needed) before the second lands.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Iterable

import torch

from foundation import device as hd
from foundation.compat import queue_backward_callback
from hetero.optim.param_slots import DTensor, ParamSlot, computes_with_dtensor


class _Bucket:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.items: list[tuple[ParamSlot, torch.Tensor]] = []
        self.nbytes = 0
        self.event: torch.Event | hd.HostEvent | None = None  # set once the copies are issued


def _on_grad(owner: weakref.ref, key: int, param: torch.Tensor) -> None:
    # The hook holds the offloader weakly: a deleted optimizer frees its host buffers, and its
    # hooks (removed by a finalizer) leave .grad to torch.
    offloader = owner()
    if offloader is None or param.grad is None:
        return
    grad, param.grad = param.grad, None
    if isinstance(grad, DTensor):  # a semi-auto parameter: its reduction hook ran first
        if tuple(grad.placements) != tuple(param.placements):
            raise RuntimeError(
                f"a DTensor parameter of shape {tuple(param.shape)} reached OffloadAdam's "
                f"gradient hook with {grad.placements} gradients, not its own placements "
                f"{param.placements}: the hook that reduces them must be registered first "
                f"(build the optimizer after parallel.parallelize)")
        grad = grad.to_local()
    offloader.add(offloader.slots[key], grad, from_backward=True)


def _remove(handles: list) -> None:
    for handle in handles:
        handle.remove()


class GradOffloader:
    """Copies device gradients of offloaded parameters into their host landing buffers."""

    def __init__(self, bucket_cap_bytes: int, max_in_flight: int = 2) -> None:
        self.bucket_cap_bytes = bucket_cap_bytes
        self.max_in_flight = max_in_flight
        self.held_bytes = 0          # device gradient bytes referenced by open/in-flight buckets
        self.peak_held_bytes = 0
        self.generation = 0          # bumped whenever the set of host gradients changes
        self._open: dict[torch.device, _Bucket] = {}
        self._in_flight: list[_Bucket] = []
        self._streams: dict[torch.device, torch.Stream] = {}
        self.slots: dict[int, ParamSlot] = {}  # by id(param), for the hooks
        self._handles: list = []
        weakref.finalize(self, _remove, self._handles)
        self._callback_queued = False
        self._lock = threading.RLock()  # CPU and accelerator backward run on different threads

    def attach(self, slots: Iterable[ParamSlot]) -> None:
        """Hook every offloaded, trainable parameter of ``slots``."""
        owner = weakref.ref(self)
        for slot in slots:
            # a parameter sharded by optimizer parallel gets its gradient assigned by a
            # reduce-scatter, never accumulated by autograd: it is taken at step(). A semi-auto
            # parameter's is accumulated, then reduced by semi-auto's hook (registered first).
            sharded = isinstance(slot.param, DTensor) and not computes_with_dtensor(slot.param)
            if not slot.in_place and slot.param.requires_grad and not sharded:
                self.slots[id(slot.param)] = slot
                self._handles.append(slot.param.register_post_accumulate_grad_hook(
                    functools.partial(_on_grad, owner, id(slot.param))))

    def add(self, slot: ParamSlot, grad: torch.Tensor, from_backward: bool = False) -> None:
        """Queue ``grad`` (a device gradient of ``slot``) for the copy to the host."""
        if grad.layout != torch.strided:
            raise ValueError(
                f"a parameter of shape {tuple(slot.param.shape)} received a {grad.layout} "
                f"gradient (nn.Embedding(sparse=True)?): OffloadAdam needs dense gradients"
            )
        with self._lock:
            self.generation += 1
            if slot.count > slot.folded:
                self._fold(slot)
            bucket = self._open.get(slot.device)
            if bucket is None:
                bucket = self._open[slot.device] = _Bucket(slot.device)
            nbytes = grad.nbytes
            bucket.items.append((slot, grad))
            bucket.nbytes += nbytes
            slot.count += 1
            slot.bucket = bucket
            self.held_bytes += nbytes
            self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
            if from_backward and not self._callback_queued:
                # Runs when this backward pass ends: send the last, partly filled bucket.
                queue_backward_callback(self.flush)
                self._callback_queued = True
            if bucket.nbytes >= self.bucket_cap_bytes:
                self._issue(bucket)

    def flush(self) -> None:
        """Issue the copies of every partly filled bucket."""
        with self._lock:
            self._callback_queued = False
            for bucket in list(self._open.values()):
                self._issue(bucket)

    def wait_all(self) -> None:
        """Flush, then block until every gradient copy has landed in host memory."""
        with self._lock:
            self.flush()
            for bucket in self._in_flight:
                bucket.event.synchronize()
            self._reap(keep=0)

    def source(self, slot: ParamSlot) -> str | None:
        """Name of the arena buffer holding ``slot``'s gradient after ``wait_all``: "staging"
        (one contribution, in the device dtype), "accum" (FP32 sum of several) or None."""
        if slot.count == 0:
            return None
        if slot.count == 1 and slot.folded == 0:
            return "staging"
        if slot.count > slot.folded:
            self._fold(slot)
        return "accum"

    def discard(self, slots: Iterable[ParamSlot]) -> None:
        """Forget all gradients (zero_grad / a skipped step); unsent device gradients are freed."""
        with self._lock:
            self.generation += 1
            for bucket in self._open.values():
                self.held_bytes -= bucket.nbytes
            self._open.clear()
            for slot in slots:
                slot.count = slot.folded = 0
                slot.bucket = None

    def stream(self, device: torch.device) -> torch.Stream:
        """The side stream for copies to and from ``device``."""
        if device not in self._streams:
            self._streams[device] = hd.new_stream(device)
        return self._streams[device]

    def _issue(self, bucket: _Bucket) -> None:
        if self._open.get(bucket.device) is bucket:
            del self._open[bucket.device]
        side = self.stream(bucket.device)
        hd.wait_stream(side, hd.current_stream(bucket.device))  # gradients are complete
        with side:
            for slot, grad in bucket.items:
                slot.arena.view("staging", slot.index).copy_(grad, non_blocking=True)
        bucket.event = hd.new_event(bucket.device)
        bucket.event.record(side)
        self._in_flight.append(bucket)
        self._reap(keep=self.max_in_flight)

    def _reap(self, keep: int) -> None:
        """Release device gradients of finished buckets; wait until at most ``keep`` remain."""
        while self._in_flight and (len(self._in_flight) > keep or self._in_flight[0].event.query()):
            bucket = self._in_flight.pop(0)
            bucket.event.synchronize()
            self.held_bytes -= bucket.nbytes
            bucket.items = [(slot, None) for slot, _ in bucket.items]  # drop the device tensors

    def _fold(self, slot: ParamSlot) -> None:
        """Add the contribution waiting in ``staging`` into the FP32 ``accum`` buffer."""
        bucket = slot.bucket
        if bucket.event is None:
            self._issue(bucket)
        bucket.event.synchronize()
        slot.arena.add("accum", torch.float32, pinned=False)
        accum = slot.arena.view("accum", slot.index)
        staged = slot.arena.view("staging", slot.index)
        if slot.folded == 0:
            accum.copy_(staged)
        else:
            accum.add_(staged)
        slot.folded = slot.count
