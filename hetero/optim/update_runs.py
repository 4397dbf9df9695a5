"""The update's plumbing around the kernel: what it runs on, and where the results go.

``build_runs`` turns a param group's slots into kernel :class:`~hetero.optim.host_kernels.Run`\\ s:
neighbouring offloaded parameters of one arena whose gradients sit in the same buffer and whose
step counters agree become one contiguous run (usually a whole group is one run), so the kernel is
called a handful of times per step. ``send_back`` issues the copies of the updated weights to the
device copies on the side stream and makes the compute stream wait for them with an event: the
next forward sees the new weights and the host never blocks. ``reseed_edited`` keeps masters in
step with weights that something else wrote.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import increment_version

from foundation import device as hd
from hetero.local_parts import local
from hetero.optim.grad_buckets import GradOffloader
from hetero.optim.host_kernels import Run
from hetero.optim.param_slots import ParamSlot


def build_runs(slots: list[ParamSlot], grads: GradOffloader,
               updated: list[ParamSlot]) -> list[Run]:
    """Runs of ``slots`` that have gradients, stepping their counters; offloaded slots that
    will be updated are appended to ``updated``."""
    spans: list[list] = []  # [arena, first, last, gradient buffer, step]
    runs = []
    for slot in slots:
        if slot.in_place:
            if slot.grad is not None:
                # the kernel writes through ``.data``, which autograd's version counter does
                # not see: count the write, so a cached copy of the weights (a host-homed
                # parameter's pinned copy, ``hetero.placement.transfer``) knows it is stale
                increment_version(local(slot.param))
                slot.step += 1
                runs.append(Run(slot.tensor, slot.grad, slot.exp_avg,
                                slot.exp_avg_sq, None, int(slot.step)))
            continue
        source = grads.source(slot)
        if source is None:
            continue
        slot.step += 1
        step = int(slot.step)
        updated.append(slot)
        last = spans[-1] if spans else None
        if (last and last[0] is slot.arena and last[2] + 1 == slot.index
                and last[3] == source and last[4] == step):
            last[2] = slot.index
        else:
            spans.append([slot.arena, slot.index, slot.index, source, step])
    for arena, first, last, source, step in spans:
        out = arena.span("out", first, last) if arena.has("out") else None
        runs.append(Run(arena.span("master", first, last), arena.span(source, first, last),
                        arena.span("exp_avg", first, last),
                        arena.span("exp_avg_sq", first, last), out, step))
    return runs


def send_back(slots: list[ParamSlot], grads: GradOffloader) -> dict[torch.device, object]:
    """Copy the updated weights of ``slots`` to their device copies; returns the event per
    device marking the end of the copies (the host must not rewrite the sources before it)."""
    by_device: dict[torch.device, list[ParamSlot]] = {}
    for slot in slots:
        by_device.setdefault(slot.device, []).append(slot)
    sent = {}
    for device, group in by_device.items():
        side, compute = grads.stream(device), hd.current_stream(device)
        hd.wait_stream(side, compute)  # the device is done reading the old weights
        with side:
            for slot in group:
                source = "out" if slot.arena.has("out") else "master"
                slot.tensor.copy_(slot.arena.view(source, slot.index), non_blocking=True)
        event = hd.new_event(device)
        event.record(side)
        event.wait(compute)  # the next forward waits for the new weights, the host does not
        sent[device] = event
    for slot in slots:
        slot.mark_written()
    return sent


@torch.no_grad()
def reseed_edited(slots: list[ParamSlot]) -> None:
    """Re-read the master of any offloaded parameter whose weights were changed outside the
    optimizer (a model ``load_state_dict`` of other weights, an in-place init)."""
    for slot in slots:
        if slot.in_place or not slot.edited_outside():
            continue
        p = slot.param
        if p.device != slot.device or p.dtype != slot.device_dtype:
            raise RuntimeError(
                f"a parameter of shape {tuple(p.shape)} moved from {slot.device}/"
                f"{slot.device_dtype} to {p.device}/{p.dtype} after OffloadAdam was built; "
                f"build the optimizer after placing/casting the model")
        current = slot.tensor.to(slot.master.device)
        # Loading a checkpoint writes back the master's own downcast (DCP's set_state_dict
        # loads the model after the optimizer): the FP32 bits are kept then.
        if not torch.equal(current, slot.master.to(p.dtype)):
            slot.master.copy_(current)
        slot.mark_written()
