"""``UnitSchedule``: a model's layers brought in one at a time around their forward and backward.

Two holders keep a layer's tensors somewhere else between uses and bring them back only for it:
optimizer parallel's level3 on gloo (``parallel.optimizer_parallel.resharded``: each weight
all-gathered from the ranks' slices) and parameter offload (``hetero.offload.params``: each weight
copied from host memory). When is the same for both, and lives here; how a unit's tensors arrive
and leave is each holder's (:meth:`UnitSchedule._fetch`, :meth:`UnitSchedule._drop`):

* a unit arrives in its forward pre-hook and the next ``prefetch`` units, in the order the last
  step's forward ran them, start arriving while it computes; it leaves in its forward hook, except
  the last unit, whose backward follows at once (torchtitan's rule); while backward runs (a
  recomputed forward) nothing leaves and nothing is prefetched;
* when the first gradient of a unit's outputs arrives, the unit arrives again for its backward,
  and the units whose backward comes next (this step's order, backwards) start arriving;
* :meth:`UnitSchedule._end_step` closes a step: this step's order becomes the one the next
  forward prefetches by.

:func:`unit_owners` says which unit owns a tensor: the one unit every module registering it lies
in; a tensor registered outside every unit, or in two, belongs to the root (-1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from foundation.layers import tensors_needing_grad


def unit_owners(units: Sequence[nn.Module], holders: Sequence[Sequence[nn.Module]]
                ) -> list[int]:
    """For each entry of ``holders`` (the modules registering one tensor): the index of the one
    unit all of them lie in, else -1 (the root)."""
    units_of: dict[int, set[int]] = {}  # id(module) -> the units it is part of
    for index, unit in enumerate(units):
        for module in unit.modules():
            units_of.setdefault(id(module), set()).add(index)
    owners = []
    for modules in holders:
        held = set().union(*(units_of.get(id(module), {-1}) for module in modules))
        owners.append(held.pop() if len(held) == 1 and -1 not in held else -1)
    return owners


class UnitSchedule:
    """When units arrive and leave (module docstring). A holder calls :meth:`_init_schedule`,
    hooks its units with :meth:`_hook_units`, implements :meth:`_fetch` and :meth:`_drop`, and
    calls :meth:`_end_step` when a step's backward is done."""

    def _init_schedule(self, prefetch: int) -> None:
        self.prefetch = prefetch
        self.backward_running = False
        #: units in the order this step's forward ran them, and the last step's
        self.order: list[int] = []
        self.last_order: list[int] = []

    def _hook_units(self, units: Sequence[nn.Module], owned: Sequence[bool]) -> list[Any]:
        """Forward hooks on every unit that owns something; returns their handles."""
        handles = []
        for index, unit in enumerate(units):
            if not owned[index]:
                continue
            last = index == len(units) - 1
            handles += [
                unit.register_forward_pre_hook(lambda *_, i=index: self._before_unit(i)),
                unit.register_forward_hook(
                    lambda _m, _a, out, i=index, last=last: self._after_unit(i, out, last))]
        return handles

    def _fetch(self, indices: list[int], wait: bool) -> None:
        """Bring these units' tensors; ``wait``: complete before returning (about to be used),
        else only started (a prefetch)."""
        raise NotImplementedError

    def _drop(self, index: int) -> None:
        """Let this unit's tensors go until it is needed again."""
        raise NotImplementedError

    def _backward_begins(self) -> None:
        self.backward_running = True

    def _ahead(self, index: int, step: int) -> list[int]:
        """The ``prefetch`` units after unit ``index`` going ``step`` (+1: forward, by the last
        step's order, as this step's is still being recorded; -1: backward, by this step's);
        none where the order is not known."""
        order = self.last_order if step > 0 else self.order
        if index not in order or not self.prefetch:
            return []
        at = order.index(index)
        if step > 0:
            return order[at + 1:at + 1 + self.prefetch]
        return order[max(at - self.prefetch, 0):at][::-1]

    def _before_unit(self, index: int) -> None:
        self._fetch([index], wait=True)
        if self.backward_running or not torch.is_grad_enabled():
            return  # a forward recomputed in backward, or an evaluation: no prefetch
        self.order.append(index)
        self._fetch(self._ahead(index, +1), wait=False)

    def _after_unit(self, index: int, output: Any, last: bool) -> None:
        if not torch.is_grad_enabled():
            self._drop(index)
            return
        if self.backward_running:  # a recomputed forward: its backward comes next
            return
        grads = tensors_needing_grad(output)
        if grads:
            torch.autograd.graph.register_multi_grad_hook(
                grads, lambda _: self._before_backward(index), mode="any")
        if not last:
            self._drop(index)

    def _before_backward(self, index: int) -> None:
        self._backward_begins()
        self._fetch([index], wait=True)
        self._fetch(self._ahead(index, -1), wait=False)

    def _end_step(self) -> None:
        self.backward_running = False
        if self.order:
            self.last_order, self.order = self.order, []
