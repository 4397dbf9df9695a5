"""Module-deletion split (torchtitan's): a stage is the model with the other stages' units gone.

A unit inside a layer stack is dropped from the stack, whose keys are kept, so ``blocks.2`` is
still ``blocks.2`` in ``state_dict()`` and a ``for block in self.blocks`` loop runs only this
stage's layers. Any other unit becomes ``None``, so the model's forward must skip a missing part
and pass its input through (``x = self.embed(x) if self.embed is not None else x``; and return
the hidden state when the head is gone) — the convention torchtitan's models follow. Real modules
stay (no tracing), so placement, semi-auto sharding and data parallel apply to a stage unchanged.

Why by hand: torch's ``pipeline()`` tracer splits an exported graph, whose modules are no longer
the user's classes, so module-level tags (``hetero.set_device``, ``parallel.shard``) would not
find them.
"""

from __future__ import annotations

import copy

from torch import nn

_STACKS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def carve(model: nn.Module, keep: set[str], units: set[str], *, in_place: bool) -> nn.Module:
    """``model`` holding only the units in ``keep``. ``in_place``: change ``model`` itself (its
    dropped units are released); otherwise a shallow copy sharing the kept modules and tensors."""
    def visit(module: nn.Module, prefix: str, in_place: bool) -> nn.Module:
        target = module if in_place else copy.copy(module)
        if not in_place:
            target._modules = dict(module._modules)
            target._parameters = dict(module._parameters)
            target._buffers = dict(module._buffers)
        for name, child in list(module._modules.items()):
            path = prefix + name
            if path in units:
                if path not in keep:
                    if isinstance(module, _STACKS):
                        del target._modules[name]
                    else:
                        target._modules[name] = None
            elif child is not None and any(u.startswith(path + ".") for u in units):
                target._modules[name] = visit(child, path + ".", in_place)
        return target

    return visit(model, "", in_place)
