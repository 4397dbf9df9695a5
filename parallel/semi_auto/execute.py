"""Running one tagged operator: bring its inputs to their layouts, compute, place the output.

Inputs become DTensors on the operator's mesh (a plain tensor is the full value on every rank:
``Replicate``) and are redistributed to the placements of the operator's layouts with DTensor's
own ``redistribute``, whose backward is the reverse communication, so gradients need nothing
extra. An operator whose rule allows it then runs on each rank's slices through
``torch.distributed.tensor.experimental.local_map``, with the output placements the layouts
derived (``Partial`` for a split contracting dimension) and the gradient placements of inputs
that were not split along a mesh dimension the operator divides (``Partial``: each rank holds the
contribution of its slice). Other operators go through DTensor's dispatch. What happened at the
last call is kept in a ``CallRecord`` for ``explain_sharding``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate
from torch.distributed.tensor.experimental import local_map

from foundation.collective_check import check as check_collective
from foundation.collective_check import enabled as check_mode
from parallel.errors import collective_guard
from parallel.semi_auto.mesh import describe_transition, mesh_dims_used, placements
from parallel.semi_auto.strategy import OpPlan

#: inside ``overlapped_outputs()``: output placements are only issued, and waited on first use
_ASYNC_OUTPUTS: contextvars.ContextVar[bool] = contextvars.ContextVar("async_outputs",
                                                                      default=False)


@contextlib.contextmanager
def overlapped_outputs() -> Iterator[None]:
    """Issue the output redistributions (partial-sum reductions) of tagged operators without
    waiting: work issued before their results are used overlaps them (``parallel.multi_copy``).
    Outside it they complete at once, so outputs are plain, waited tensors."""
    token = _ASYNC_OUTPUTS.set(True)
    try:
        yield
    finally:
        _ASYNC_OUTPUTS.reset(token)


@dataclasses.dataclass
class CallRecord:
    """Placements seen at the last call: per input (name, before, after), and the output."""

    inputs: list[tuple[str, tuple[Placement, ...], tuple[Placement, ...]]] = dataclasses.field(
        default_factory=list)
    output: tuple[Placement, ...] = ()
    output_comms: list[str] = dataclasses.field(default_factory=list)
    calls: int = 0

    def communication(self) -> list[str]:
        comms = [f"{name}: {c}" for name, before, after in self.inputs
                 for c in describe_transition(before, after)]
        return comms + [f"output: {c}" for c in self.output_comms]


def to_dtensor(value: torch.Tensor, mesh: DeviceMesh, what: str) -> DTensor:
    """``value`` as a DTensor on ``mesh``; a plain tensor is taken as the same on every rank."""
    if isinstance(value, DTensor):
        if value.device_mesh != mesh:
            raise ValueError(f"{what}: an input lives on {value.device_mesh}, but the operator "
                             f"runs on {mesh}; parallelize the model that holds both")
        return value
    return DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)


def _check_redistribution(what: str, dt: DTensor, target: tuple, mesh: DeviceMesh) -> None:
    """In check mode, every rank agrees on the global shape, dtype and both layouts before the
    redistribution's collectives run (a mesh over the whole job; sub-meshes are left to torch's
    DETAIL wrapper)."""
    if check_mode() and mesh.size() == dist.get_world_size():
        check_collective("redistribute", dt.to_local(), what=f"semi-auto redistribution of {what}",
                         shape=dt.shape, params=(zlib.crc32(str(tuple(dt.placements)).encode()),
                                                 zlib.crc32(str(target).encode())))


def bring_to_layouts(plan: OpPlan, tensors: Sequence[Any], mesh: DeviceMesh,
                     record: CallRecord) -> list[DTensor | None]:
    """Each present input redistributed to its layout's placements (recorded)."""
    shape = tuple(mesh.shape)
    record.inputs = []
    moved: list[DTensor | None] = []
    for i, value in enumerate(tensors):
        if value is None:
            moved.append(None)
            continue
        dt = to_dtensor(value, mesh, plan.what)
        target = placements(plan.inputs[i], shape, plan.what)
        record.inputs.append((plan.rule.input_names[i], tuple(dt.placements), target))
        if tuple(dt.placements) != target:
            with collective_guard(f"semi-auto redistribution of {plan.what}'s input {i}"):
                _check_redistribution(f"{plan.what}'s input {i}", dt, target, mesh)
                dt = dt.redistribute(mesh, target)
        moved.append(dt)
    return moved


def run_local(plan: OpPlan, fn: Callable[..., torch.Tensor], inputs: Sequence[DTensor | None],
              mesh: DeviceMesh) -> DTensor:
    """``fn`` on each rank's slices of ``inputs`` (already in their layouts), as a DTensor."""
    shape = tuple(mesh.shape)
    present = [(i, dt) for i, dt in enumerate(inputs) if dt is not None]
    divided = mesh_dims_used(tuple(plan.inputs[i] for i, _ in present), shape)
    in_placements = tuple(tuple(dt.placements) for _, dt in present)
    grad_placements = tuple(
        tuple(p if p.is_shard() else Partial() if j in divided else Replicate()
              for j, p in enumerate(pl))
        for pl in in_placements)

    def on_slices(*local: torch.Tensor) -> torch.Tensor:
        full = [None] * len(inputs)
        for (i, _), tensor in zip(present, local, strict=True):
            full[i] = tensor
        return fn(full)

    mapped = local_map(on_slices, out_placements=(placements(plan.output, shape, plan.what),),
                       in_placements=in_placements, in_grad_placements=grad_placements,
                       device_mesh=mesh)
    return mapped(*(dt for _, dt in present))


def place_output(plan: OpPlan, out: Any, mesh: DeviceMesh, record: CallRecord) -> Any:
    """Apply ``out_strategy`` (reduce partial sums as asked) and record the output placements."""
    record.output_comms = []
    if isinstance(out, DTensor):
        if plan.out is not plan.output:
            target = placements(plan.out, tuple(mesh.shape), plan.what)
            record.output_comms = describe_transition(out.placements, target)
            with collective_guard(f"semi-auto out_strategy of {plan.what}"):
                _check_redistribution(f"{plan.what}'s output", out, target, mesh)
                out = out.redistribute(mesh, target, async_op=_ASYNC_OUTPUTS.get())
        record.output = tuple(out.placements)
    record.calls += 1
    return out
