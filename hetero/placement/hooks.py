"""``hetero.place(model, mode="hooks")``: placement without a graph, for models export can't take.

Each module's own parameters and buffers move to its effective device (innermost tag, else the
default). Where a module's device differs from its parent's, a forward pre-hook copies its inputs
in and a forward hook copies its outputs back to the parent's device. Coarser than the graph split
— whole modules only, ops in a parent's ``forward`` stay on the parent's device, nothing runs
concurrently — but any model that runs eagerly trains this way. A parameter registered in modules
on two devices (a tied embedding and output head) has one home, chosen as in graph mode; for the
duration of the other module's forward its registry holds a differentiable copy on that module's
device, so the gradients of both uses sum into the one parameter.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import nn

from foundation import device as hd
from foundation.compat import pytree
from foundation.lend import LendDuringForward
from foundation.model_view import ModelView
from hetero.placement.assign import _TagIndex, tensor_homes
from hetero.placement.plan import Partition, Plan
from hetero.placement.transfer import to_device


def _moved(tree: Any, device: Any) -> Any:
    return pytree.tree_map(lambda v: to_device(v, device), tree)


class HookPlacedModule(ModelView):
    """The model itself, with its tensors on their devices and boundary hooks installed."""

    def __init__(self, model: nn.Module, plan: Plan) -> None:
        super().__init__(model)
        self.plan = plan

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._model(*args, **kwargs)


def place_with_hooks(model: nn.Module, default: str = "device") -> HookPlacedModule:
    """Move tensors to their modules' devices and hook every device boundary (see module doc)."""
    tags = _TagIndex(model, hd.logical_name(default), {})
    homes = tensor_homes(model, tags)  # refuses contradictory tags on a shared tensor
    groups: dict[str, list[str]] = {}  # boundary module path -> module paths it covers
    for path, module in model.named_modules():
        dev = tags.effective(path)
        parent = path.rpartition(".")[0]
        boundary = path if not path or tags.effective(parent) != dev else None
        if boundary is None:
            boundary = next(b for b in reversed(list(groups)) if not b or path.startswith(b + "."))
        groups.setdefault(boundary, []).append(path)
        borrowed = []
        for name, tensor in [*module.named_parameters(recurse=False),
                             *module.named_buffers(recurse=False)]:
            home = homes[f"{path}.{name}" if path else name]
            if tensor.device != hd.resolve(home):
                tensor.data = tensor.data.to(hd.resolve(home))
            if home != dev:
                borrowed.append(name)
        if borrowed:
            LendDuringForward(module, borrowed, partial(to_device, device=hd.resolve(dev)))
        if boundary == path:
            outer = hd.resolve(tags.effective(parent)) if path else None
            inner = hd.resolve(dev)
            module.register_forward_pre_hook(
                lambda m, a, k, d=inner: _moved((a, k), d), with_kwargs=True)
            if outer is not None:
                module.register_forward_hook(lambda m, a, out, d=outer: _moved(out, d))
    partitions = []
    for i, (boundary, paths) in enumerate(groups.items()):
        dev = tags.effective(boundary)
        tensors = [n for n, h in homes.items() if n.rpartition(".")[0] in paths]
        nbytes = sum(t.numel() * t.element_size() for n, t in
                     [*model.named_parameters(), *model.named_buffers()] if n in tensors)
        partitions.append(Partition(i, boundary or "<root>", dev, hd.resolve(dev), [], paths,
                                    nbytes, 0, 0, []))
    return HookPlacedModule(model, Plan(partitions, homes, mode="hooks"))
