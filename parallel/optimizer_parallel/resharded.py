"""Optimizer parallel level3 without FSDP2 where gathers run chunkwise (gloo): ZeRO-3 on the
whole/slice faces of :mod:`.whole_weights`.

Why: FSDP2 all-gathers a unit into one flat buffer and copies every parameter out of it, and
copies every gradient into another for the reduce-scatter. An accelerator's side streams hide
those copies; on the host nothing does, and level3 stepped at 1.55-1.67x a data-parallel step
(``benchmarks/optimizer_parallel.py``), about 48 ms of it in the copies. Here each parameter's
whole tensor is itself the gather's output: its storage is allocated, this rank's rows copied in
from the slice and every rank's rows broadcast in place into it (:func:`.chunkwise
.broadcast_ranges`, uneven rows included). Between uses the storage is released (resized to
0, as FSDP does), so the module and the autograd graph keep referring to the same tensors.

When (``foundation.unit_schedule``, shared with parameter offload; the units are
:func:`.units.unit_modules`' layers, as FSDP2's would be):

* a unit gathers in its forward pre-hook and releases in its forward hook, except the last unit,
  whose backward follows at once (torchtitan's rule); while backward runs (a recomputed
  forward) nothing is released;
* when the first gradient of a unit's outputs arrives, the unit gathers again for its backward,
  and each of its parameters is released once its gradient is accumulated (autograd sums a tied
  weight's uses first);
* parameters outside any single unit (the root's, ties across units) are gathered when the
  model's forward starts and released when the step's gradients are reduced. A weight that a
  module outside its unit reads directly (``F.linear(x, layer.weight)``) must be registered
  there as well (a tie), as FSDP2 requires too: else it is read while released, and torch
  raises that its storage is too small.

Gradients are level2's (:class:`parallel.data.grad_reducer.GradReducer` in keep mode: all-reduced in
buckets while backward runs, this rank's rows kept): no whole gradient outlives its bucket.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from foundation.layers import tensors_needing_grad
from foundation.unit_schedule import UnitSchedule, unit_owners
from foundation.weak_hooks import weak_hook
from parallel.errors import collective_guard
from parallel.optimizer_parallel.chunkwise import broadcast_ranges
from parallel.optimizer_parallel.whole_weights import WholeWeights, _Pair

_WHAT = "optimizer parallel (level3) weight gather"


def can_release(params: Iterable[nn.Parameter]) -> bool:
    """Whether each of ``params`` alone owns a resizable storage that it fills from the start,
    so releasing and regrowing that storage touches no other tensor."""
    seen: set[int] = set()
    for p in params:
        storage = p.untyped_storage()
        if (not storage.resizable() or p.storage_offset() != 0 or not p.is_contiguous()
                or storage.nbytes() != p.nbytes or storage.data_ptr() in seen):
            return False
        seen.add(storage.data_ptr())
    return True


class ReshardedWeights(WholeWeights, UnitSchedule):
    """The whole/slice faces of ``params`` with the whole tensors released between uses
    (module docstring); ``units``: the modules gathered and released one at a time
    (``foundation.unit_schedule``: when; here: how, by broadcasts from the slices)."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], mesh: DeviceMesh,
                 units: list[nn.Module]) -> None:
        self._init_schedule(prefetch=1)
        self.in_flight: dict[int, list[dist.Work]] = {}  # id(pair) -> its broadcasts
        super().__init__(model, params, mesh, "level3")
        owners = unit_owners(units, [[module for module, _ in pair.slots]
                                     for pair in self.pairs])
        self.root_pairs = [pair for pair, o in zip(self.pairs, owners, strict=True) if o < 0]
        self.unit_pairs = [[pair for pair, o in zip(self.pairs, owners, strict=True)
                            if o == index] for index in range(len(units))]
        self.hooks += self._hook_units(units, [bool(pairs) for pairs in self.unit_pairs])
        # each whole tensor's storage released once its gradient is in; the hook holds this
        # object weakly and its pair by position (the pair's slice is a DTensor on the mesh:
        # held by the hook, it would keep the process groups alive, foundation/weak_hooks.py)
        position = {id(pair): i for i, pair in enumerate(self.pairs)}
        for pairs in self.unit_pairs:
            for pair in pairs:
                self.hooks.append(pair.whole.register_post_accumulate_grad_hook(
                    weak_hook(self._release_after_grad, position[id(pair)])))

    def _release_after_grad(self, position: int, _param: torch.Tensor) -> None:
        self._release([self.pairs[position]])

    def _pair(self, whole: nn.Parameter, slots: list[tuple[nn.Module, str]], name: str
              ) -> _Pair:
        pair = super()._pair(whole, slots, name)
        # the slice owns its rows: the whole tensor's storage is released between uses
        pair.part = nn.Parameter(self._dtensor(pair.part.to_local().clone(), whole),
                                 requires_grad=whole.requires_grad)
        return pair

    def enter(self) -> None:
        """Before a forward: the whole tensors registered, the root's gathered."""
        self.backward_running = False  # also where the last backward reduced nothing
        if not self.at_rest:
            return
        self._check_views()
        self._register(whole=True)
        self._gather(self.root_pairs)
        self.at_rest = False

    def _check_views(self) -> None:
        for pair in self.pairs:
            local = pair.part.to_local()
            if local.dtype != pair.whole.dtype:
                raise RuntimeError(
                    f"ShardedDataParallel(level=level3): the slice of {pair.name} is "
                    f"{local.dtype} but its weight {pair.whole.dtype} (its .data was replaced); "
                    f"for 16-bit weights give ShardedDataParallel(param_dtype=...)")

    def _issue(self, pairs: list[_Pair]) -> None:
        """Regrow the released whole tensors of ``pairs``, copy this rank's rows in from the
        slices and start broadcasting every rank's rows in place (waited for by
        :meth:`_gather`)."""
        with torch.no_grad(), collective_guard(_WHAT, self.group):
            for pair in pairs:
                storage = pair.whole.untyped_storage()
                if storage.nbytes() or not pair.whole.numel():
                    continue  # resident or on its way already (a tie, a prefetch)
                storage.resize_(pair.whole.nbytes)
                # ``.data``: writes that leave the version counter of the tensor autograd
                # saved for backward as it was (the values are the ones it saw)
                flat = pair.whole.data.view(-1)
                a, b = pair.flat_rows[self.rank]
                flat[a:b].copy_(pair.part.to_local().reshape(-1))
                self.in_flight[id(pair)] = broadcast_ranges(flat, pair.flat_rows, self.group)

    def _gather(self, pairs: list[_Pair]) -> None:
        """``pairs``' whole tensors, complete."""
        self._issue(pairs)
        with collective_guard(_WHAT, self.group):
            for pair in pairs:
                for work in self.in_flight.pop(id(pair), ()):
                    work.wait()

    def _release(self, pairs: list[_Pair]) -> None:
        self._gather([pair for pair in pairs if id(pair) in self.in_flight])  # never under
        for pair in pairs:  # a broadcast still writing
            pair.whole.untyped_storage().resize_(0)

    def _fetch(self, indices: list[int], wait: bool) -> None:
        """Gather these units' whole tensors (``wait``), or issue their gathers (a prefetch:
        FSDP2's, the next unit's gather running while this one computes; every rank issues it
        at the same point of the schedule, so the collectives match)."""
        pairs = [pair for index in indices for pair in self.unit_pairs[index]]
        (self._gather if wait else self._issue)(pairs)

    def _drop(self, index: int) -> None:
        self._release(self.unit_pairs[index])

    def _after_forward(self, output: Any) -> None:
        super()._after_forward(output)
        grads = tensors_needing_grad(output)
        if grads and torch.is_grad_enabled():  # backward starts where the model's output is
            torch.autograd.graph.register_multi_grad_hook(  # first given its gradient
                grads, lambda _: self._backward_begins(), mode="any")

    def leave(self, rows: dict[int, torch.Tensor] | None = None) -> None:
        super().leave(rows)
        self._release(self.pairs)
        self._end_step()
