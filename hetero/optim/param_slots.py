"""Where each parameter's optimizer state lives, and the checks made before any of it exists.

Every parameter gets a :class:`ParamSlot`. There are two kinds:

* **offloaded** — the parameter the model computes with (the "device copy") is on the
  accelerator, or is held in a 16-bit ``param_dtype``. The FP32 master weight and both moments
  live in host memory; gradients are copied down into a pinned landing buffer and the updated
  weights are sent back.
* **in place** — an FP32 parameter that already lives in host memory: a CPU partition of a
  ``hetero.place``'d model, or every parameter when there is no accelerator and
  ``param_dtype=None``. The parameter *is* its master weight, its gradient is already on the
  host, and it is updated in place exactly as ``torch.optim.AdamW`` would. There is no second
  copy: a separate FP32 "device copy" on the host would double the weight memory and add a copy
  per step for nothing, and users keep torch's semantics (``p.grad`` stays readable, edits of
  ``p`` are the master).

``param_dtype`` applies to parameters on ``hetero.device.resolve("device")``; parameters elsewhere
on the host keep their dtype. Without an accelerator "device" *is* the CPU, so there every
parameter takes ``param_dtype`` (that is how the 16-bit path runs on a CPU-only machine).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from foundation import device as hd
from foundation.compat import recast_dtensor_, tensor_version
from hetero.local_parts import (  # noqa: F401 (re-exported)
    FP32_SEED_ATTR,
    DTensor,
    computes_with_dtensor,
    local,
)
from hetero.optim.host_arena import HostArena
from hetero.optim.pinned_chunks import chunk_sizes

SUPPORTED_PARAM_DTYPES = (torch.float16, torch.bfloat16)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclasses.dataclass(eq=False)
class ParamSlot:
    """One parameter's optimizer state and host-gradient bookkeeping."""

    param: torch.nn.Parameter
    in_place: bool
    arena: HostArena
    index: int
    device: torch.device
    device_dtype: torch.dtype
    step: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(()))
    #: (data_ptr, version counter) of the device copy after the optimizer last wrote it.
    written: tuple[int, int] = (0, 0)
    #: Gradient contributions since the last step/zero_grad (offloaded slots).
    count: int = 0
    #: How many of those are summed into the "accum" buffer already.
    folded: int = 0
    #: The bucket carrying the newest contribution, until it has been waited for.
    bucket: Any = None

    @property
    def tensor(self) -> torch.Tensor:
        """The weights this rank updates: the parameter's data, or its local shard when the
        parameter is a sharded DTensor (optimizer parallel: each rank keeps state for its slice
        only)."""
        return local(self.param).data

    @property
    def grad(self) -> torch.Tensor | None:
        """This rank's part of the parameter's ``.grad`` (None when it has none)."""
        grad = self.param.grad
        return None if grad is None else local(grad)

    @property
    def master(self) -> torch.Tensor:
        """The FP32 weight the update reads and writes (the parameter itself when in place)."""
        return self.tensor if self.in_place else self.arena.view("master", self.index)

    @property
    def exp_avg(self) -> torch.Tensor:
        return self.arena.view("exp_avg", self.index)

    @property
    def exp_avg_sq(self) -> torch.Tensor:
        return self.arena.view("exp_avg_sq", self.index)

    def state(self) -> dict[str, torch.Tensor]:
        """``torch.optim.AdamW``'s per-parameter state layout, plus the FP32 master if separate."""
        state = {"step": self.step, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        if not self.in_place:
            state["fp32_master"] = self.master
        if isinstance(self.param, DTensor):  # slices of a sharded parameter: say which (DCP)
            p = self.param
            for key in ("exp_avg", "exp_avg_sq", "fp32_master"):
                if key in state:
                    state[key] = DTensor.from_local(state[key], p.device_mesh, p.placements,
                                                    shape=p.shape, stride=p.stride(),
                                                    run_check=False)
        return state

    def mark_written(self) -> None:
        """Remember the device copy as the optimizer left it (see ``edited_outside``)."""
        self.written = (local(self.param).data_ptr(), tensor_version(local(self.param)))

    def edited_outside(self) -> bool:
        """True when something else wrote the device copy since the optimizer did (a model
        ``load_state_dict``, an in-place init): the tensor version counter moved."""
        return (local(self.param).data_ptr(), tensor_version(local(self.param))) != self.written


def _where(group: int, index: int) -> str:
    return f"parameter {index} of param group {group}"


def check_param(p: Any, group: int, index: int) -> None:
    """Raise a clear error for a parameter the offloaded optimizer cannot keep."""
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{_where(group, index)} is a {type(p).__name__}, not a tensor")
    if not p.is_leaf:
        raise ValueError(f"{_where(group, index)} is not a leaf tensor (it was computed from "
                         f"others); an optimizer can only update leaves such as nn.Parameter")
    if p.is_complex():
        raise ValueError(f"{_where(group, index)} is complex ({p.dtype}): OffloadAdam keeps FP32 "
                         f"master weights and does not support complex parameters")
    if isinstance(p, DTensor) and any(not pl.is_replicate() and not pl.is_shard()
                                      for pl in p.placements):
        raise ValueError(f"{_where(group, index)} is a DTensor with placements {p.placements}: "
                         f"OffloadAdam updates sharded or replicated parameters, not partial "
                         f"sums")
    p = local(p)
    if p.layout != torch.strided:
        raise ValueError(f"{_where(group, index)} has layout {p.layout}: only dense (strided) "
                         f"parameters are supported")
    if p.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{_where(group, index)} has dtype {p.dtype}: OffloadAdam keeps FP32 "
                         f"master weights for float32, float16 and bfloat16 parameters")


def check_dtensor_dtype(p: torch.Tensor, dtype: torch.dtype, group: int, index: int) -> None:
    """A parameter sharded by optimizer parallel cannot change dtype under its sharding (FSDP2
    gathers in the dtype it was sharded with): refuse a ``param_dtype`` it does not already have.
    A semi-auto DTensor (computed with directly) may: only its local shard is recast."""
    if isinstance(p, DTensor) and p.dtype != dtype and not computes_with_dtensor(p):
        raise ValueError(f"{_where(group, index)} is a sharded {p.dtype} DTensor but param_dtype "
                         f"is {dtype}: cast the model to {dtype} before sharding it "
                         f"(model.to({dtype}) before parallel.parallelize); the FP32 masters "
                         f"are then seeded from those weights")


def device_dtype_for(p: torch.Tensor, param_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype the model's copy of ``p`` is held in."""
    if param_dtype is not None and p.device == hd.resolve("device"):
        return param_dtype
    return p.dtype


def _arena_key(p: torch.Tensor, dtype: torch.dtype, offload: bool) -> tuple:
    in_place = not offload or (p.device.type == "cpu" and dtype == torch.float32)
    return ("in_place", p.device) if in_place else ("offloaded", p.device, dtype)


def _chunked(idx: list[int], params: list[torch.Tensor], pinned: bool) -> list[list[int]]:
    """``idx`` cut into the chunks of ``pinned_chunks.chunk_sizes`` (whole when not pinned)."""
    if not pinned:
        return [idx]
    chunks, start = [], 0
    for size in chunk_sizes([local(params[i]).numel() for i in idx]):
        chunks.append(idx[start:start + size])
        start += size
    return chunks


def host_share(params: Sequence[torch.Tensor], ratio: float) -> list[bool]:
    """Which of ``params`` keep their optimizer state on the host so that ``ratio`` of the
    elements do (Megatron's ``--optimizer-offload-fraction``): the first parameters in order,
    up to the one that reaches the share (whole parameters: a tensor is not split)."""
    total = sum(local(p).numel() for p in params)
    chosen, taken = [], 0
    for p in params:
        take = taken < ratio * total and ratio > 0
        chosen.append(take)
        taken += local(p).numel() if take else 0
    return chosen


def build_slots(params: Iterable[torch.nn.Parameter], param_dtype: torch.dtype | None,
                offload: bool | Sequence[bool] = True) -> list[ParamSlot]:
    """Allocate one group's host state and seed the FP32 masters; the model is not touched
    (:func:`adopt_slots` casts the device copies once every group has been built). A group
    with ``offload=False`` keeps its FP32 parameters where they are, its state beside them, and
    is updated there in place (as ``torch.optim.AdamW`` would); a list says it per parameter
    (:func:`host_share`)."""
    params = list(params)
    each = [offload] * len(params) if isinstance(offload, bool) else list(offload)
    dtypes = [device_dtype_for(p, param_dtype) if off else p.dtype
              for p, off in zip(params, each, strict=True)]
    members: dict[tuple, list[int]] = {}
    for i, (p, dtype) in enumerate(zip(params, dtypes, strict=True)):
        members.setdefault(_arena_key(p, dtype, each[i]), []).append(i)
    if hd.can_pin():  # pinned buffers: in chunks, so the allocator's rounding wastes little
        members = {(*key, part): chunk for key, idx in members.items()
                   for part, chunk in enumerate(_chunked(idx, params, key[0] == "offloaded"))}
    arenas: dict[tuple, HostArena] = {}
    for key, idx in members.items():
        arena = HostArena([local(params[i]).shape for i in idx],
                          device=key[1] if key[0] == "in_place" else None)
        arena.add("exp_avg", torch.float32, pinned=False, zero=True)
        arena.add("exp_avg_sq", torch.float32, pinned=False, zero=True)
        if key[0] == "offloaded":
            dtype = key[2]
            # The master is sent back itself when the device copy is FP32, else via "out".
            arena.add("master", torch.float32, pinned=dtype == torch.float32)
            arena.add("staging", dtype, pinned=True)
            if dtype != torch.float32:
                arena.add("out", dtype, pinned=True)
        arenas[key] = arena
    slots: list[ParamSlot | None] = [None] * len(params)
    for key, idx in members.items():
        for j, i in enumerate(idx):
            p = params[i]
            slot = ParamSlot(p, key[0] == "in_place", arenas[key], j, p.device, dtypes[i])
            if not slot.in_place:
                seed = getattr(p, FP32_SEED_ATTR, None)
                use_seed = seed is not None and seed.shape == slot.master.shape
                slot.master.copy_(seed if use_seed else slot.tensor)
            slots[i] = slot
    return slots  # type: ignore[return-value]


def adopt_slots(slots: list[ParamSlot]) -> None:
    """Give the model its ``param_dtype`` copies: all of them are made first, then swapped in,
    so a failure (out of device memory) leaves every parameter as it was. A semi-auto DTensor
    parameter keeps its placements and hooks; its local shard is the one recast."""
    with torch.no_grad():
        cast = {id(s): s.master.to(s.device, s.device_dtype) for s in slots
                if s.param.dtype != s.device_dtype}
        for slot in slots:
            if id(slot) in cast and isinstance(slot.param, DTensor):  # check_dtensor_dtype
                recast_dtensor_(slot.param, cast[id(slot)])
            elif id(slot) in cast:
                slot.param.data = cast[id(slot)]
            slot.mark_written()
            if hasattr(slot.param, FP32_SEED_ATTR):
                delattr(slot.param, FP32_SEED_ATTR)  # the master holds it now
