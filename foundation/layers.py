"""A model's layers: the modules that are brought in and let go of one at a time.

As torchtitan does for its transformer blocks, every layer of the outermost layer stacks (the
items of an ``nn.ModuleList``, ``nn.ModuleDict`` or ``nn.Sequential``) is one unit; what is left
(embeddings, final norm, head) belongs to the root. Optimizer parallel's FSDP2 units and
gathers (``parallel.optimizer_parallel``) and parameter offload (``hetero.offload``) both walk
a model this way, so one layer's weights arrive while the previous layer computes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from foundation.compat import pytree

_STACKS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def unit_modules(model: nn.Module) -> list[nn.Module]:
    """The layers of the outermost layer stacks in ``model`` (a stack inside a layer is part of
    that layer's unit), in model order; layers without parameters are left to the root."""
    found: list[nn.Module] = []

    def walk(module: nn.Module) -> None:
        if isinstance(module, _STACKS):
            found.extend(m for m in module.children() if any(True for _ in m.parameters()))
            return
        for child in module.children():
            walk(child)

    walk(model)
    return found


def tensors_needing_grad(output: Any) -> list[torch.Tensor]:
    """The tensors in a layer's ``output`` (any nesting) that autograd will send gradients to:
    where a hook on "the first gradient of this layer's outputs" (its backward starting) goes."""
    return [t for t in pytree.tree_leaves(output)
            if isinstance(t, torch.Tensor) and t.requires_grad]
